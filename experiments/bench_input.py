r"""What the host gives the devices: a config's training batches, placed, per
second, alone and with the training loop's bookkeeping, and where their
time goes.

  python -m experiments.bench_input --out=experiments/results/bench_input \
      [--config=configs/lm_stdlib.py] [--steps_per_call=1,16] \
      [--batches=2000] [--config.key=value ...]

Three rows at each of --steps_per_call (its intervals rounded up to
multiples of it; default: the config's), each after --warmup batches:
  pipeline:  the run's own iterator (trainer.training_batches, this host's
             rows), each call's batches handed to a jitted step that does
             no work, which places them on the devices as the train
             step's own call does (Program.place, its in_shardings);
  loop:      the same with the loop's bookkeeping (metrics.TrainLog): the
             no-work step's metrics fetched one call late, checked,
             summed and logged, the progress bar; what a model's step
             adds nothing to;
  profiled:  the pipeline under cProfile, its time split by stage (reading
             the examples, windowing and packing each row, assembling the
             batch, placing it, the rest) from the functions' cumulative
             times, in the loop's thread (a dataset read from files by
             threads of their own has their work in the rest); slower
             than the pipeline row by the profiler's cost.
Placed batches a second and their tokens (rows x seq_len) a second.

Writes OUT/results.{jsonl,md,csv}; without --out, OUT is a fresh folder of
workdirs/ (common.results_folder).
"""

import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags

from configs import lm_stdlib
from experiments import common
from train import cli
from train.base.errors import InputError
from train.config import validation as config_validation
from train.data import datasets
from train.program import sharding
from train.run import metrics, trainer
from train.run.program import Program

FLAGS = flags.FLAGS

# Stages of the profile of a language model's packed or padded rows
# (train/data/packing.py; other pipelines' time is 'other'): each the
# cumulative time of the functions named (file name ending, function),
# less that of the stages within it.
STAGES = {
    'placing': (('experiments/bench_input.py', 'to_devices'),),
    'assembling': (('train/data/packing.py', 'assemble'),),
    'windowing and packing': (('train/data/packing.py', 'take'),),
    'reading': (('train/data/packing.py', '_next_document'),),
}
# Stage: the stages its functions' time includes.
_WITHIN = {'windowing and packing': ('reading',)}


def _calls(config, batches: int) -> list[int]:
  """The steps of each call for `batches` batches."""
  return [count for _, count in trainer.calls(0, batches,
                                              config.steps_per_call)]


def _no_step(program: Program, guard: metrics.NonFiniteGuard):
  """`batches -> metrics`: the call of a step that does no work, its
  batch argument placed as the train step's is (Program.place, the
  step's in_shardings), its metrics those a step returns (zeros, stacked
  [K] for several)."""
  names = ('loss_sum', 'correct_sum', 'weight_sum', 'token_count',
           'learning_rate', 'grad_norm') + (('skipped',) if guard.skips
                                            else ())
  steps = {stacked: jax.jit(
      lambda batch: {name: jnp.sum(batch['weights'], axis=(-2, -1)) * 0.0
                     for name in names},
      in_shardings=(sharding.batch_sharding(program.mesh, stacked=stacked),))
           for stacked in (False, True)}

  def to_devices(batches: list[dict]) -> dict:
    return steps[len(batches) > 1](program.place(batches))
  return to_devices


def _compile(to_devices, iterator, counts) -> None:
  """The no-work step compiled once for each count of `counts`, on
  batches of `iterator` (untimed)."""
  for count in sorted(set(counts)):
    jax.block_until_ready(to_devices([next(iterator) for _ in range(count)]))


def _pipeline(program: Program, dataset: datasets.Dataset, counts,
              profile: cProfile.Profile | None = None) -> float:
  """Seconds of the calls of `counts` batches: the run's iterator, each
  call's batches handed to a step that does no work; `profile`, if
  given, profiles them (not the compilations before)."""
  to_devices = _no_step(program, metrics.NonFiniteGuard('stop', 0))
  iterator = trainer.training_batches(program, dataset)
  try:
    _compile(to_devices, iterator, counts)
    if profile is not None:
      profile.enable()
    start, done = time.perf_counter(), None
    for count in counts:
      done = to_devices([next(iterator) for _ in range(count)])
    jax.block_until_ready(done)
    seconds = time.perf_counter() - start
    if profile is not None:
      profile.disable()
    return seconds
  finally:
    iterator.close()


def _loop(program: Program, dataset: datasets.Dataset, counts,
          workdir: str) -> float:
  """Seconds of the same with the loop's bookkeeping: each call's metrics
  fetched one call late, checked, summed and logged."""
  config = program.config
  writer = metrics.MetricWriter(workdir, total_steps=sum(counts),
                                first_step=0)
  guard = metrics.NonFiniteGuard(config.nan_policy, config.max_skipped_steps)
  log = metrics.TrainLog(writer, config.log_every, sum(counts), guard)
  to_devices = _no_step(program, guard)
  iterator = trainer.training_batches(program, dataset)
  done = 0
  try:
    _compile(to_devices, iterator, counts)
    start = time.perf_counter()
    for count in counts:
      done += count
      logged = log.add(done, to_devices(
          [next(iterator) for _ in range(count)]), count)
      if logged:
        writer.write(*logged)
    log.complete()
    return time.perf_counter() - start
  finally:
    iterator.close()
    writer.close()


def _stages(profile: cProfile.Profile, seconds: float) -> dict[str, float]:
  """{stage: seconds} of a profile of `seconds`, 'other' the rest."""
  cumulative = {}
  for (path, _, function), (_, _, _, total, _) in pstats.Stats(
      profile).stats.items():
    for stage, names in STAGES.items():
      if any(path.endswith(ending) and function == name
             for ending, name in names):
        cumulative[stage] = cumulative.get(stage, 0.0) + total
  stages = {stage: cumulative.get(stage, 0.0) - sum(
      cumulative.get(inner, 0.0) for inner in _WITHIN.get(stage, ()))
            for stage in STAGES}
  stages['other'] = seconds - sum(stages.values())
  return stages


def _measure(config: ml_collections.ConfigDict, *, batches: int,
             warmup: int) -> list[dict]:
  """The three rows of `config` (at its steps_per_call)."""
  program = Program.from_config(config)
  config = program.config
  with tempfile.TemporaryDirectory() as workdir:
    dataset = datasets.load(config, workdir)
    counts = _calls(config, batches)
    if warmup:
      _pipeline(program, dataset, _calls(config, warmup))
    seconds = _pipeline(program, dataset, counts)
    loop_seconds = _loop(program, dataset, counts, workdir)
    profile = cProfile.Profile()
    profiled = _pipeline(program, dataset, counts, profile)
  tokens = config.batch_size * config.seq_len
  rows = []
  for name, time_s in (('pipeline', seconds), ('loop', loop_seconds),
                       ('profiled', profiled)):
    row = {'row': name, 'batches': batches,
           'steps_per_call': config.steps_per_call,
           'batches_per_s': batches / time_s,
           'ms_per_batch': 1e3 * time_s / batches,
           'tokens_per_s': tokens * batches / time_s}
    if name == 'profiled':
      row |= {f'{stage} ms': 1e3 * stage_s / batches
              for stage, stage_s in _stages(profile, time_s).items()}
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def run(config: ml_collections.ConfigDict, out: str, *, batches: int,
        warmup: int, steps_per_call: list[int] = (),
        command: str = '') -> list[dict]:
  """The three rows of `config` at each of `steps_per_call` (default: the
  config's); writes OUT/results.{jsonl,md,csv}."""
  if batches < 1 or warmup < 0:
    raise InputError(f'--batches={batches} must be at least 1 and '
                     f'--warmup={warmup} at least 0.')
  configs = [with_steps_per_call(config, steps) for steps in steps_per_call]
  for checked in configs or [config]:
    config_validation.check(checked)  # Every one before any is measured.
  rows = [row for checked in configs or [config]
          for row in _measure(checked, batches=batches, warmup=warmup)]
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'results.jsonl'), 'w') as lines:
    for row in rows:
      lines.write(json.dumps(row) + '\n')
  columns = ['row', 'batches', 'steps_per_call', 'batches_per_s',
             'ms_per_batch', 'tokens_per_s',
             *[f'{stage} ms' for stage in (*STAGES, 'other')]]
  preamble = (
      '# Input pipeline: placed training batches a second\n\n'
      + (f'Command: `{command}`\n\n' if command else '')
      + f'Machine: {common.machine_description()}.\n\n'
      f'Config: {config.dataset}, {config.batch_size} rows of '
      f'{config.seq_len} tokens ({trainer.row_layout(config)}); '
      f'{batches} batches timed after {warmup}. pipeline: the run\'s '
      'iterator, each call\'s batches placed on the devices by a step that '
      'does no work; loop: with the training loop\'s bookkeeping of its '
      'metrics; profiled: the pipeline under cProfile, split by stage (ms '
      'a batch).\n\n')
  print(common.write_table(rows, columns, os.path.join(out, 'results'),
                           preamble))
  return rows


def with_steps_per_call(config: ml_collections.ConfigDict, steps: int
                        ) -> ml_collections.ConfigDict:
  """`config` at `steps` steps a call, its intervals (which must be
  multiples of it) rounded up to multiples."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.steps_per_call = steps
  for key in ('log_every', 'eval_every', 'checkpoint_every'):
    if config[key] > 0:
      config[key] = -(-config[key] // steps) * steps
  return config


def main(argv: list[str]) -> None:
  common.results_main(argv, 'bench_input', lambda out: run(
      FLAGS.config, out, batches=FLAGS.batches, warmup=FLAGS.warmup,
      steps_per_call=common.parse_integers('--steps_per_call',
                                           FLAGS.steps_per_call),
      command='python -m experiments.bench_input ' + ' '.join(sys.argv[1:])))


def _define_flags() -> None:
  """The command line, defined only when this runs as a script."""
  config_flags.DEFINE_config_file(
      'config', lm_stdlib.__file__, 'Training config whose pipeline is '
      'measured.', lock_config=True)
  common.define_out_flag('bench_input')
  flags.DEFINE_list('steps_per_call', [], 'Steps a call, each measured '
                    '(default: the config\'s).')
  flags.DEFINE_integer('batches', 2000, 'Timed batches.', lower_bound=1)
  flags.DEFINE_integer('warmup', 100, 'Batches first, untimed.',
                       lower_bound=0)


if __name__ == '__main__':
  cli.run(main, _define_flags)
