r"""Command line: decode a split with a trained encoder-decoder and score it.

  python -m train.translate --workdir=DIR [--split=validation] \
      [--beam_size=4 --alpha=0.6 --batch_size=32 --max_examples=0 \
       --max_length=0]

Loads the run's latest checkpoint and decodes the split's inputs by beam
search (greedy at --beam_size=1), a key/value cache per beam. Writes one
hypothesis per line to DIR/<split>.hyp and the references to DIR/<split>.ref
(detokenised text for text datasets, token ids otherwise) and prints exact
match, per-token accuracy and, for text, BLEU (sacrebleu's, which
`sacrebleu DIR/<split>.ref -i DIR/<split>.hyp` repeats).
"""

from absl import flags

from train import cli
from train.base import storage
from train.base.errors import InputError
from train.decode import seq2seq_eval
from train.run import trained_run

FLAGS = flags.FLAGS


def translate(workdir: str, split: str = 'validation', *, beam_size: int = 4,
              alpha: float = 0.6, batch_size: int = 32, max_examples: int = 0,
              max_length: int = 0) -> dict[str, float]:
  """Decodes `split` (its first `max_examples`; 0: all), writes the files
  and returns the scores. `max_length` bounds the output tokens (0: 1.5
  times the longest input, plus 10)."""
  for name, value in (('beam_size', beam_size), ('batch_size', batch_size)):
    if value < 1:
      raise InputError(f'--{name}={value} must be at least 1.')
  run = trained_run.load(workdir, decoder='train.translate')
  if split not in run.dataset.splits:
    raise InputError(f'--split={split!r} is not a split of '
                     f'{run.config.dataset!r}; it has '
                     f'{sorted(run.dataset.splits)}.')
  decode_set = seq2seq_eval.take(run.dataset, split, max_examples or -1)
  decoder = seq2seq_eval.beam_decoder(
      run.model, run.dataset.vocab_size, beam_size=beam_size, alpha=alpha,
      num_tokens=seq2seq_eval.output_length(
          run.model_config, decode_set.source_len, max_length,
          names=f'--split={split!r}'))
  hypotheses = seq2seq_eval.decode(decoder, run.params, decode_set,
                                   batch_size=batch_size, progress=True)
  text = seq2seq_eval.as_text(run.dataset)
  for name, rows in (('hyp', hypotheses), ('ref', decode_set.references)):
    storage.write_whole(storage.path(workdir) / f'{split}.{name}',
                        ''.join(text(row) + '\n' for row in rows))
  return {'examples': len(hypotheses)} | seq2seq_eval.score(
      run.dataset, hypotheses, decode_set.references)


def main(argv: list[str]) -> None:
  result = cli.run_main(argv, lambda: translate(
      FLAGS.workdir, FLAGS.split, beam_size=FLAGS.beam_size,
      alpha=FLAGS.alpha, batch_size=FLAGS.batch_size,
      max_examples=FLAGS.max_examples, max_length=FLAGS.max_length))
  print(', '.join(f'{key} {value:.4g}' for key, value in result.items()))


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'An encoder-decoder\'s training '
                      'workdir.')
  flags.DEFINE_string('split', 'validation', 'Split to decode.')
  flags.DEFINE_integer('beam_size', 4, 'Hypotheses kept; 1 is greedy.')
  flags.DEFINE_float('alpha', 0.6, 'Length penalty exponent (GNMT); 0 ranks '
                     'by log-probability alone.')
  flags.DEFINE_integer('batch_size', 32, 'Inputs decoded at once.')
  flags.DEFINE_integer('max_examples', 0, 'Decode the first N; 0 for all.')
  flags.DEFINE_integer('max_length', 0, 'Output tokens at most; 0: 1.5 times '
                       'the longest input, plus 10.')
  flags.mark_flags_as_required(['workdir'])
  cli.run(main)
