r"""Start-up cost against depth: how long building, tracing, lowering and
compiling a train step take as the model gets deeper, in one run.

  python -m experiments.bench_compile --out=experiments/results/bench_compile \
      [--size=small] [--layers=2,8,24] [--layouts=unscanned,scanned] \
      [--steps=3] [--config.key=value ...]

For each layout of the blocks (config.model.scan_layers False, True) and
each depth, `train.train`'s own train step of --config (default
configs/lm_stdlib.py) at bench_train's --size (its shape, one window a
row), with config.model.num_layers set to it:
  build_s    Program.from_config: the config checked (the model traced for
             its parameters' shapes and layout), the step functions built
  trace_s    the train step traced to a jaxpr
  lower_s    the jaxpr lowered to StableHLO
  compile_s  XLA's compilation
  step_s     a compiled step's time on a synthetic batch (--steps timed)
and the ratios to the same layout's first depth (measured twice, the first
time untimed) of build + trace, of compile, and of trace + compile (what
scanning the blocks keeps flat); a scanned row's step time is also given
against the unscanned one's at its depth.
A pod pays build, trace and compile once per host and per trial at every
start; they grow with depth when every layer is traced and compiled on
its own.

Every row's config is checked before any is measured. Writes
OUT/<backend>/results.jsonl, results.md and results.csv; without --out,
OUT is a fresh folder of workdirs/ (common.results_folder): the committed
results change only when --out names them.
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
from train.config import validation as config_validation
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


LAYOUTS = {'unscanned': False, 'scanned': True}


def run(base, out: str, *, size: str, layers: list[int], steps: int,
        layouts: tuple[str, ...] = tuple(LAYOUTS), command: str = ''
        ) -> list[dict]:
  """A row per layout in `layouts` and depth in `layers`; writes
  OUT/<backend>/results.{jsonl,md,csv} and returns the rows."""
  if size not in bench_train.SIZES:
    raise InputError(f'--size: unknown size {size!r}; known: '
                     f'{", ".join(bench_train.SIZES)}.')
  if steps < 1:
    raise InputError(f'--steps={steps} must be at least 1.')
  unknown = sorted(set(layouts) - set(LAYOUTS))
  if unknown or not layouts:
    raise InputError(f'--layouts: {unknown[0] if unknown else "none"} is '
                     f'not one of {", ".join(LAYOUTS)}.')
  def config_at(depth: int, layout: str):
    config = bench_train.our_config(base, size, attention='auto',
                                    dtype=base.model.dtype,
                                    remat=base.model.remat)
    config.model.update(num_layers=depth, scan_layers=LAYOUTS[layout])
    return config

  for layout in layouts:  # Every row checked before any is measured.
    for depth in layers:
      try:
        config_validation.validate(config_at(depth, layout))
      except InputError as error:
        raise InputError('\n'.join(
            f'--layouts={layout} at --layers={depth}: {line}'
            for line in str(error).splitlines())) from None
  directory = os.path.join(out, jax.default_backend())
  os.makedirs(directory, exist_ok=True)

  def ratio(row, first, *keys):
    return sum(row[key] for key in keys) / sum(first[key] for key in keys)

  rows, unscanned = [], {}
  with open(os.path.join(directory, 'results.jsonl'), 'w') as lines:
    for layout in layouts:
      # Once untimed: the first program of a layout built in a process
      # also pays for what every later one reuses (JAX's and flax's own
      # set-up, the scan's).
      measure(config_at(layers[0], layout), steps=1)
      first = None
      for depth in layers:
        row = {'layers': depth, 'scan_layers': LAYOUTS[layout],
               **measure(config_at(depth, layout), steps=steps)}
        first = first or row
        row['build_trace_vs_first'] = ratio(row, first, 'build_s', 'trace_s')
        row['compile_vs_first'] = ratio(row, first, 'compile_s')
        row['trace_compile_vs_first'] = ratio(row, first, 'trace_s',
                                              'compile_s')
        if not LAYOUTS[layout]:
          unscanned[depth] = row['step_s']
        row['step_vs_unscanned'] = (row['step_s'] / unscanned[depth]
                                    if depth in unscanned else None)
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
      'ratios are to the first row of the same layout (scan_layers), '
      'and a scanned step\'s to the unscanned one at its depth.\n\n')
  print(common.write_table(
      rows, ['scan_layers', 'layers', 'params', 'build_s', 'trace_s',
             'lower_s', 'compile_s', 'step_s', 'build_trace_vs_first',
             'compile_vs_first', 'trace_compile_vs_first',
             'step_vs_unscanned'],
      os.path.join(directory, 'results'), preamble))
  return rows


def main(argv: list[str]) -> None:
  common.results_main(argv, 'bench_compile', lambda out: run(
      FLAGS.config, out, size=FLAGS.size,
      layers=common.parse_integers('--layers', FLAGS.layers),
      steps=FLAGS.steps, layouts=tuple(FLAGS.layouts),
      command='python -m experiments.bench_compile ' + ' '.join(
          sys.argv[1:])))


def _define_flags() -> None:
  """The command line, defined only when this runs as a script."""
  config_flags.DEFINE_config_file(
      'config', lm_stdlib.__file__, 'Training config file; the size sets '
      'its shape, --layers its depth.', lock_config=True)
  common.define_out_flag('bench_compile')
  flags.DEFINE_enum('size', 'small', list(bench_train.SIZES),
                    "bench_train's shape.")
  flags.DEFINE_list('layers', ['2', '8', '24'], 'Depths measured.')
  flags.DEFINE_list('layouts', list(LAYOUTS), 'Layouts of the blocks '
                    'measured: unscanned, scanned (config.model.scan_layers).')
  flags.DEFINE_integer('steps', 3, 'Steps timed (after one untimed).')


if __name__ == '__main__':
  cli.run(main, _define_flags)
