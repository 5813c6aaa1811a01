r"""Start-up cost against depth: how long building, tracing, lowering and
compiling a train step take as the model gets deeper, in one run.

  python -m experiments.bench_compile --out=experiments/results/bench_compile \
      [--size=small] [--layers=2,8,24] [--steps=3] [--config.key=value ...]

For each depth, `train.train`'s own train step of --config (default
configs/lm_stdlib.py) at bench_train's --size (its shape, one window a
row), with config.model.num_layers set to it:
  build_s    Program.from_config: the config checked (the model traced for
             its parameters' shapes and layout), the step functions built
  trace_s    the train step traced to a jaxpr
  lower_s    the jaxpr lowered to StableHLO
  compile_s  XLA's compilation
  step_s     a compiled step's time on a synthetic batch (--steps timed)
and the ratios of build + trace and of compile to the first depth's (which
is measured twice, the first time untimed).
A pod pays build, trace and compile once per host and per trial at every
start; they grow with depth when every layer is traced and compiled on
its own.

Writes OUT/<backend>/results.jsonl, results.md and results.csv.
"""

import json
import os
import sys
import time

from absl import flags
import jax
from ml_collections import config_flags

from configs import lm_stdlib
from experiments import bench_train, common
from train import cli
from train.base.errors import InputError
from train.run.program import Program

FLAGS = flags.FLAGS


def measure(config, *, steps: int) -> dict:
  """The start-up costs (seconds) and the step time of `config`."""
  started = time.perf_counter()
  program = Program.from_config(config)
  built = time.perf_counter()
  batch = program.batch(program.task.synthetic_batch(program.config))
  rng = program.key(1)
  with program.scope():
    traced_at = time.perf_counter()
    traced = program.train_step.trace(program.abstract_state, batch, rng)
    lowered_at = time.perf_counter()
    lowered = traced.lower()
    compiling_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    state = program.init()
    seconds = common.time_steps(
        lambda state, batch: compiled(state, batch, rng), state, batch,
        steps=steps, warmup=1)
  return {'params': program.num_params, 'build_s': built - started,
          'trace_s': lowered_at - traced_at,
          'lower_s': compiling_at - lowered_at,
          'compile_s': compiled_at - compiling_at, 'step_s': seconds}


def run(base, out: str, *, size: str, layers: list[int], steps: int,
        command: str = '') -> list[dict]:
  """A row per depth in `layers`; writes OUT/<backend>/results.{jsonl,md,
  csv} and returns the rows."""
  if size not in bench_train.SIZES:
    raise InputError(f'--size: unknown size {size!r}; known: '
                     f'{", ".join(bench_train.SIZES)}.')
  if steps < 1:
    raise InputError(f'--steps={steps} must be at least 1.')
  directory = os.path.join(out, jax.default_backend())
  os.makedirs(directory, exist_ok=True)
  def config_at(depth: int):
    config = bench_train.our_config(base, size, attention='auto',
                                    dtype=base.model.dtype,
                                    remat=base.model.remat)
    config.model.num_layers = depth
    return config

  # Once untimed: the first program built in a process also pays for
  # what every later one reuses (JAX's and flax's own set-up).
  measure(config_at(layers[0]), steps=1)
  rows = []
  with open(os.path.join(directory, 'results.jsonl'), 'w') as lines:
    for depth in layers:
      row = {'layers': depth, **measure(config_at(depth), steps=steps)}
      first = rows[0] if rows else row
      row['build_trace_vs_first'] = ((row['build_s'] + row['trace_s'])
                                     / (first['build_s'] + first['trace_s']))
      row['compile_vs_first'] = row['compile_s'] / first['compile_s']
      rows.append(row)
      lines.write(json.dumps(row) + '\n')
      print(json.dumps(row), flush=True)
  d_model, _, heads, mlp, seq_len, batch, vocab = bench_train.SIZES[size]
  preamble = (
      '# Start-up cost against depth\n\n'
      + (f'Command: `{command}`\n\n' if command else '')
      + f'Machine: {common.machine_description()}.\n\n'
      f'Size {size}: d_model {d_model}, {heads} heads, MLP {mlp}, T '
      f'{seq_len}, batch {batch}, vocabulary {vocab}. Seconds to build '
      'the program (config checked, model traced for its parameters), '
      'trace, lower and compile the train step, and a step\'s time; the '
      'ratios are to the first row\'s.\n\n')
  print(common.write_table(
      rows, ['layers', 'params', 'build_s', 'trace_s', 'lower_s',
             'compile_s', 'step_s', 'build_trace_vs_first',
             'compile_vs_first'],
      os.path.join(directory, 'results'), preamble))
  return rows


def main(argv: list[str]) -> None:
  cli.run_main(argv, lambda: run(
      FLAGS.config, FLAGS.out, size=FLAGS.size,
      layers=common.parse_integers('--layers', FLAGS.layers),
      steps=FLAGS.steps,
      command='python -m experiments.bench_compile ' + ' '.join(
          sys.argv[1:])))


def _define_flags() -> None:
  """The command line, defined only when this runs as a script."""
  config_flags.DEFINE_config_file(
      'config', lm_stdlib.__file__, 'Training config file; the size sets '
      'its shape, --layers its depth.', lock_config=True)
  flags.DEFINE_string('out', 'experiments/results/bench_compile',
                      'Results go to OUT/<backend>/.')
  flags.DEFINE_enum('size', 'small', list(bench_train.SIZES),
                    "bench_train's shape.")
  flags.DEFINE_list('layers', ['2', '8', '24'], 'Depths measured.')
  flags.DEFINE_integer('steps', 3, 'Steps timed (after one untimed).')


if __name__ == '__main__':
  cli.run(main, _define_flags)
