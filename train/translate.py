"""Command line: decode a split with a trained encoder-decoder and score it.

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

import os

from absl import app
from absl import flags
import jax
import numpy as np

from model.families import init_cache
from train import cli, decoding, scores, trained_run
from train.data import tokenizers
from train.errors import InputError

FLAGS = flags.FLAGS


def _until_eos(ids) -> list[int]:
  """The ids up to and including the first EOS (all of them if none)."""
  ids = [int(i) for i in ids]
  return ids[:ids.index(tokenizers.EOS_ID) + 1] if (
      tokenizers.EOS_ID in ids) else ids


def translate(workdir: str, split: str = 'validation', *, beam_size: int = 4,
              alpha: float = 0.6, batch_size: int = 32, max_examples: int = 0,
              max_length: int = 0) -> dict[str, float]:
  """Decodes `split` (its first `max_examples`; 0: all), writes the files
  and returns the scores. `max_length` bounds the output tokens (0: 1.5
  times the longest input, plus 10)."""
  for name, value in (('beam_size', beam_size), ('batch_size', batch_size)):
    if value < 1:
      raise InputError(f'--{name}={value} must be at least 1.')
  run = trained_run.load(workdir)
  if run.dataset.kind != 'seq2seq':
    raise InputError(f'{workdir} holds a {run.model_config.family}; '
                     'train.translate decodes encoder-decoders.')
  if split not in run.dataset.splits:
    raise InputError(f'--split={split!r} is not a split of '
                     f'{run.config.dataset!r}; it has '
                     f'{sorted(run.dataset.splits)}.')
  examples = run.dataset.splits[split]
  count = len(examples) if not max_examples else min(max_examples,
                                                     len(examples))
  sources = [np.asarray(examples[i]['inputs']) for i in range(count)]
  references = [_until_eos(examples[i]['targets']) for i in range(count)]
  source_len = max(len(s) for s in sources)
  num_tokens = max_length or int(1.5 * source_len) + 10
  if run.model_config.position == 'learned':
    # A learned table has no position from max_len on; the decoder reads a
    # start token, then its outputs.
    if source_len > run.model_config.max_len:
      raise InputError(
          f'--split={split!r} has inputs of {source_len} tokens, more than '
          f'the {run.model_config.max_len} learned positions of the model.')
    num_tokens = min(num_tokens, run.model_config.max_len - 1)

  @jax.jit
  def decode(params, inputs_BxS):
    step = decoding.seq2seq_step(run.model, params, inputs_BxS,
                                 run.dataset.vocab_size)
    start_Bx1 = np.zeros((inputs_BxS.shape[0], 1), np.int32)
    tokens_BxKxN, _ = decoding.beam_search(
        step, init_cache(run.model_config, inputs_BxS.shape[0],
                         1 + num_tokens),
        start_Bx1, np.ones(inputs_BxS.shape[0], np.int32),
        beam_size=beam_size, num_tokens=num_tokens,
        eos_id=tokenizers.EOS_ID, alpha=alpha)
    return tokens_BxKxN[:, 0]

  hypotheses = []
  for start in range(0, count, batch_size):
    batch = np.zeros((batch_size, source_len), np.int32)
    for row, source in enumerate(sources[start:start + batch_size]):
      batch[row, :len(source)] = source
    outputs = np.asarray(decode(run.params, batch))
    hypotheses += [_until_eos(row) for row in
                   outputs[:min(batch_size, count - start)]]

  tokenizer = run.dataset.tokenizer
  as_text = (tokenizer.decode if tokenizer is not None else
             lambda ids: ' '.join(str(i) for i in ids))
  paths = {}
  for name, rows in (('hyp', hypotheses), ('ref', references)):
    paths[name] = os.path.join(workdir, f'{split}.{name}')
    with open(paths[name], 'w') as f:
      f.writelines(as_text(row) + '\n' for row in rows)
  result = {'examples': count,
            'exact_match': scores.exact_match(hypotheses, references),
            'token_accuracy': scores.token_accuracy(hypotheses, references)}
  if tokenizer is not None:
    result['bleu'] = scores.bleu_of_files(paths['hyp'], paths['ref'])
  return result


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
  app.run(main, flags_parser=cli.parse_flags)
