r"""Command line: text from a trained language model.

  python -m train.generate --workdir=DIR --prompt="def " \
      [--max_new_tokens=200 --temperature=0.8 --top_k=0 --top_p=1.0 \
       --num_samples=1 --seed=0]

Loads the run's latest checkpoint; reads the prompt in one call, then
generates up to --max_new_tokens tokens with a key/value cache, stopping a
sample at the end of a document. Prints each sample, prompt included.

The prompt is encoded as the run's tokenizer makes one: bytes and
SentencePiece put the document boundary (the id every document starts
with) before it; an imported tokenizer.json encodes it as its own
post-processor does, as transformers does (Llama's adds its BOS, GPT-2's
nothing): begin the text with the boundary token (GPT-2's <|endoftext|>)
to start a document there.
"""

from absl import flags
import jax

from model.positions import SCHEMES
from train import cli
from train.base.errors import InputError
from train.decode import text
from train.run import trained_run

FLAGS = flags.FLAGS


def generate(workdir: str, prompt: str, *, max_new_tokens: int,
             temperature: float, top_k: int = 0, top_p: float = 1.0,
             num_samples: int = 1, seed: int = 0) -> list[str]:
  """`num_samples` texts continuing `prompt` (see
  train/decode/decoding.py: choose)."""
  for name, value, ok, must in (
      ('max_new_tokens', max_new_tokens, max_new_tokens >= 1, 'at least 1'),
      ('temperature', temperature, temperature >= 0, '>= 0 (0 is greedy)'),
      ('top_k', top_k, top_k >= 0, '>= 0 (0 keeps every token)'),
      ('top_p', top_p, 0 < top_p <= 1, 'in (0, 1]'),
      ('num_samples', num_samples, num_samples >= 1, 'at least 1')):
    if not ok:
      raise InputError(f'--{name}={value} must be {must}.')
  run = trained_run.load(workdir, decoder='train.generate')
  # A learned table has no position from max_len on.
  return text.continue_text(
      run.model, run.params, run.dataset, prompt, num_tokens=max_new_tokens,
      rng=jax.random.key(seed), num_samples=num_samples,
      max_positions=SCHEMES[run.model_config.position].max_positions(
          run.model_config),
      prompt_key='--prompt', temperature=temperature, top_k=top_k,
      top_p=top_p)


def main(argv: list[str]) -> None:
  texts = cli.run_main(argv, lambda: generate(
      FLAGS.workdir, FLAGS.prompt, max_new_tokens=FLAGS.max_new_tokens,
      temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
      num_samples=FLAGS.num_samples, seed=FLAGS.seed))
  for number, sample in enumerate(texts):
    print(f'--- sample {number} ---\n{sample}')


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'A language model\'s training workdir.')
  flags.DEFINE_string('prompt', '', 'Text to continue, encoded as the '
                      'run\'s tokenizer makes a prompt: after the document '
                      'boundary for bytes and SentencePiece, as its own '
                      'post-processor does for an imported tokenizer.json '
                      '(Llama\'s adds its BOS, GPT-2\'s nothing: begin the '
                      'text with <|endoftext|> to start a document).')
  flags.DEFINE_integer('max_new_tokens', 200, 'Tokens to generate at most.')
  flags.DEFINE_float('temperature', 0.8, 'Softmax temperature; 0 is greedy. '
                     'Applied first, before --top_k and --top_p.')
  flags.DEFINE_integer('top_k', 0, 'Sample among the k most likely tokens; '
                       '0 for all. Applied after the temperature.')
  flags.DEFINE_float('top_p', 1.0, 'Sample within the smallest set of tokens '
                     'holding this much probability (nucleus) of the '
                     'tempered distribution left by --top_k; 1 for all.')
  flags.DEFINE_integer('num_samples', 1, 'Samples to draw.')
  flags.DEFINE_integer('seed', 0, 'Seeds the draws.')
  flags.mark_flags_as_required(['workdir'])
  cli.run(main)
