r"""Train-step time of the RNN encoder-decoder with attention (Bahdanau et
al. 2015) against the Transformer encoder-decoder, against length, in one
run: recurrence against self-attention, as the course notes compare them.

  python -m experiments.bench_seq2seq --out=experiments/results/bench_seq2seq \
      [--lengths=16,32,64,128,256] [--batch=16] [--steps=5 --warmup=1] \
      [--config.key=value ...]

Both models take configs/algorithmic.py's model (d_model 128; the
Transformer's encoder and decoder 2 blocks each of 4 heads and MLP 512; the
RNN's LSTM cells 128 wide), its optimizer, and synthetic batches of random
source rows of the length with their reverse as targets, data parallel over
the devices. For each length: each model's step time, the RNN's over the
Transformer's, and the sequential steps of a forward pass: the RNN's 2T
(T encoder steps, both directions at once, then T decoder steps, each
waiting for the one before), the Transformer's 2 x num_layers blocks (each
over every position at once), whatever the length.

Writes OUT/<backend>/results.jsonl, results.md, results.csv and
scaling.png; without --out, OUT is a fresh folder of workdirs/
(common.results_folder).
"""

import json
import os
import sys

from absl import flags
import jax
import ml_collections
from ml_collections import config_flags

from configs import algorithmic
from experiments import common
from model import families
from train import cli
from train.base.errors import InputError
from train.run.program import Program

FLAGS = flags.FLAGS
COMPARED = ('rnn_attention', 'encoder_decoder')


def measure(base: ml_collections.ConfigDict, family: str, length: int, *,
            batch: int, steps: int, warmup: int) -> dict:
  config = ml_collections.ConfigDict(base.to_dict())
  config.update(seq_len=length, batch_size=batch)
  config.model.update(family=family, max_len=max(base.model.max_len,
                                                 length + 1))
  program = Program.from_config(config)
  batch_arrays = program.batch(program.task.synthetic_batch(program.config))
  dropout_rng = program.key(1)
  with program.scope():
    seconds = common.time_steps(
        lambda state, arrays: program.train_step(state, arrays, dropout_rng),
        program.init(), batch_arrays, steps=steps, warmup=warmup)
  return {'family': family, 'length': length, 'step_s': seconds,
          'params': program.num_params,
          'sequential_steps': families.FAMILIES[family].sequential_steps(
              program.model_config, length)}


def run(base: ml_collections.ConfigDict, out: str, *, lengths: list[int],
        batch: int, steps: int, warmup: int, command: str = '') -> list[dict]:
  if not lengths or min(lengths) < 1:
    raise InputError(f'--lengths={lengths} must be positive lengths.')
  if steps < 1 or warmup < 1:
    raise InputError(f'--steps={steps} and --warmup={warmup} must be at '
                     'least 1 (the first warmup step compiles).')
  directory = os.path.join(out, jax.default_backend())
  os.makedirs(directory, exist_ok=True)
  rows = []
  with open(os.path.join(directory, 'results.jsonl'), 'w') as lines:
    for length in lengths:
      rnn, transformer = (measure(base, family, length, batch=batch,
                                  steps=steps, warmup=warmup)
                          for family in COMPARED)
      rnn['step_time_vs_transformer'] = rnn['step_s'] / transformer['step_s']
      for row in (rnn, transformer):
        rows.append(row)
        lines.write(json.dumps(row) + '\n')
        print(json.dumps(row), flush=True)
  by_family = {family: [(row['length'], row['step_s']) for row in rows
                        if row['family'] == family] for family in COMPARED}
  common.plot_against_length([('train step (s)', by_family)],
                             os.path.join(directory, 'scaling.png'))
  preamble = (
      '# Train step: RNN encoder-decoder with attention against the '
      'Transformer\n\n'
      + (f'Command: `{command}`\n\n' if command else '')
      + f'Machine: {common.machine_description()}.\n\n'
      f'Batch {batch} (source and target of the length), '
      f'd_model {base.model.d_model}, {steps} timed steps after {warmup}; '
      'step_time_vs_transformer > 1: the RNN is slower.\n\n')
  print(common.write_table(
      rows, ['family', 'length', 'params', 'step_s',
             'step_time_vs_transformer', 'sequential_steps'],
      os.path.join(directory, 'results'), preamble))
  return rows


def main(argv: list[str]) -> None:
  common.results_main(argv, 'bench_seq2seq', lambda out: run(
      FLAGS.config, out,
      lengths=common.parse_integers('--lengths', FLAGS.lengths),
      batch=FLAGS.batch, steps=FLAGS.steps, warmup=FLAGS.warmup,
      command='python -m experiments.bench_seq2seq '
      + ' '.join(sys.argv[1:])))


def _define_flags() -> None:
  """The command line, defined only when this runs as a script."""
  config_flags.DEFINE_config_dict(
      'config', algorithmic.get_config('task=reverse'),
      'Training config (model, optimizer); --lengths and --batch override '
      'its seq_len and batch_size.')
  common.define_out_flag('bench_seq2seq')
  flags.DEFINE_list('lengths', ['16', '32', '64', '128', '256'],
                    'Source (and target) lengths.')
  flags.DEFINE_integer('batch', 16, 'Rows a step (a multiple of the data '
                       'parallel devices).')
  flags.DEFINE_integer('steps', 5, 'Timed steps.')
  flags.DEFINE_integer('warmup', 1, 'Untimed steps first (compiling).')


if __name__ == '__main__':
  cli.run(main, _define_flags)
