"""Runs a config's hyperparameter sweep, one process per trial.

  python -m experiments.sweep --config=configs/<name>.py --workdir=DIR \
      [--parallel=N] [--metric=eval_loss --mode=min] [--set=key=value,...]

The config file defines `get_sweep()`, a list of override dicts (see
experiments/grid.py). Each trial runs `python -m train.train` in
DIR/<trial-name>/ with its overrides (and the --set ones, for every trial).
A finished trial is not run again and an interrupted one (killed, or
stopped by a signal: status 'stopped') resumes from its checkpoint, so
re-running the command continues the sweep. A trial that fails is recorded
with its error and the others go on.

Writes DIR/leaderboard.md and DIR/leaderboard.csv (trials sorted by the
metric of their final evaluation, failures last) and DIR/sweep.png (the
metric against each swept value).
"""

import concurrent.futures
import importlib.util
import math
import os
import re
import subprocess
import sys

from absl import app
from absl import flags
import matplotlib

from experiments import common

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)


FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_sweep(config_arg: str) -> list[dict]:
  """The trials of the config file's get_sweep()."""
  path = config_arg.split(':', 1)[0]
  spec = importlib.util.spec_from_file_location('sweep_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_sweep'):
    raise ValueError(f'{path} defines no get_sweep().')
  return module.get_sweep()


def trial_name(overrides: dict) -> str:
  """'learning_rate=0.001,warmup_steps=100', safe as a directory name."""
  text = ','.join(f'{key}={value}' for key, value in overrides.items())
  return re.sub(r'[^A-Za-z0-9_.,=+-]', '_', text) or 'default'


def run_trial(config_arg: str, workdir: str, overrides: dict,
              common_overrides: dict, parallel: int = 1) -> dict:
  """Runs one trial to its end (or reads its record); returns the record."""
  command = [sys.executable, '-m', 'train.train', f'--config={config_arg}',
             f'--workdir={workdir}']
  command += [f'--config.{key}={value}'
              for key, value in (common_overrides | overrides).items()]
  record_path = os.path.join(workdir, 'trial.json')
  record = common.load_json(record_path)
  if record is not None:
    if record['command'] != command[1:]:
      raise ValueError(f'{workdir} holds a trial run as '
                       f'{" ".join(record["command"])}; sweep in a new '
                       '--workdir to change the overrides.')
    if record['status'] == 'finished':
      return record
  os.makedirs(workdir, exist_ok=True)
  env = dict(os.environ)
  if parallel > 1:  # Trials on one accelerator share its memory.
    env.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', f'{0.9 / parallel:.2f}')
  with open(os.path.join(workdir, 'log.txt'), 'w') as log:
    process = subprocess.run(command, cwd=REPO, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
  record = {'overrides': overrides, 'command': command[1:]}
  evaluations = [line for line in common.read_metrics(workdir)
                 if 'eval_loss' in line]
  # A run stopped by SIGTERM or SIGINT also exits with 0, before its end.
  config = common.load_json(os.path.join(workdir, 'config.json')) or {}
  if (process.returncode == 0 and evaluations
      and evaluations[-1]['step'] == config.get('num_train_steps')):
    record |= {'status': 'finished', 'metrics': evaluations[-1]}
  elif process.returncode == 0:
    record |= {'status': 'stopped',
               'error': 'stopped before its last step; run the sweep again '
               'to resume it'}
  else:
    with open(os.path.join(workdir, 'log.txt')) as log:
      lines = [line.strip() for line in log if line.strip()]
    record |= {'status': 'failed',
               'error': lines[-1] if lines else
               f'exit status {process.returncode}'}
  common.save_json(record_path, record)
  return record


def leaderboard(records: list[dict], metric: str, mode: str) -> list[dict]:
  """Rows sorted by `metric` (best first), then the trials without a
  finite value of it (failed, or diverged), with the reason."""
  finished = [r for r in records if r['status'] == 'finished'
              and math.isfinite(r['metrics'].get(metric, math.nan))]
  finished.sort(key=lambda r: r['metrics'][metric],
                reverse=mode == 'max')
  rows = []
  for rank, record in enumerate(finished, 1):
    rows.append({'rank': rank, 'trial': trial_name(record['overrides']),
                 'status': 'finished', metric: record['metrics'][metric],
                 **record['overrides']})
  for record in records:
    if record not in finished:
      value = record.get('metrics', {}).get(metric)
      rows.append({'trial': trial_name(record['overrides']),
                   'status': record['status'],
                   'error': record.get('error', f'{metric} is {value}'),
                   **record['overrides']})
  return rows


def plot(rows: list[dict], keys: list[str], metric: str, path: str) -> None:
  """The metric against each swept key, one panel per key."""
  figure, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5),
                              squeeze=False)
  points = [row for row in rows if row['status'] == 'finished']
  for ax, key in zip(axes[0], keys):
    values = [row[key] for row in points]
    ax.scatter(values, [row[metric] for row in points])
    numeric = [v for v in values if isinstance(v, (int, float))]
    if numeric and min(numeric) > 0 and max(numeric) >= 10 * min(numeric):
      ax.set_xscale('log')
    ax.set(xlabel=key, ylabel=metric)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def sweep(config_arg: str, workdir: str, *, parallel: int = 1,
          metric: str | None = None, mode: str | None = None,
          common_overrides: dict | None = None) -> list[dict]:
  """Runs every trial not yet finished; writes the leaderboard and plot."""
  trials = load_sweep(config_arg)
  names = [trial_name(trial) for trial in trials]
  if len(set(names)) != len(names):
    raise ValueError('get_sweep() gives the same overrides twice.')
  if mode is None:
    known = dict(common.QUALITY_METRICS) | {'eval_loss': 'min'}
    if metric is not None and metric not in known:
      raise ValueError(f'say whether --metric={metric} is better low or high '
                       '(--mode=min or max).')
    mode = known.get(metric)
  os.makedirs(workdir, exist_ok=True)
  # Trials run from the repository root, as `python -m train.train`.
  path, sep, argument = config_arg.partition(':')
  config_arg = os.path.abspath(path) + sep + argument
  with concurrent.futures.ThreadPoolExecutor(max(parallel, 1)) as pool:
    try:
      records = list(pool.map(
          lambda trial: run_trial(config_arg, os.path.join(
              workdir, trial_name(trial)), trial, common_overrides or {},
                                  parallel), trials))
    except KeyboardInterrupt:
      # The running trials got the Ctrl-C too: they save and stop, and are
      # recorded; the trials not started yet are not.
      pool.shutdown(cancel_futures=True)
      raise
  if metric is None:
    finished = [r['metrics'] for r in records if r['status'] == 'finished']
    metric = common.quality_metric(finished[0] if finished else {})
    mode = dict(common.QUALITY_METRICS).get(metric, 'min')
  rows = leaderboard(records, metric, mode)
  keys = list(dict.fromkeys(key for trial in trials for key in trial))
  columns = ['rank', 'trial', 'status', metric, *keys, 'error']
  table = common.write_table(
      rows, columns, os.path.join(workdir, 'leaderboard'),
      f'# Sweep of {config_arg}\n\nRanked by {metric} ({mode}imum best), '
      f'from each trial\'s final evaluation. '
      f'Machine: {common.machine_description()}.\n\n')
  if keys and any(row['status'] == 'finished' for row in rows):
    plot(rows, keys, metric, os.path.join(workdir, 'sweep.png'))
  print(table)
  return rows


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {" ".join(argv[1:])}')
  common_overrides = {}
  for item in FLAGS.set:
    key, sep, value = item.partition('=')
    if not sep:
      raise app.UsageError(f'--set item {item!r} is not key=value.')
    common_overrides[key] = value
  sweep(FLAGS.config, os.path.abspath(FLAGS.workdir),
        parallel=FLAGS.parallel, metric=FLAGS.metric, mode=FLAGS.mode,
        common_overrides=common_overrides)


def _define_flags() -> None:
  """The command line, defined only when this runs as a script (so that
  the experiment modules can be imported together)."""
  flags.DEFINE_string(
      'config', None, 'Config file defining get_config() and get_sweep(), '
      'optionally with :argument.')
  flags.DEFINE_string('workdir', None, 'Directory of the sweep.')
  flags.DEFINE_integer('parallel', 1, 'Trials run at once.')
  flags.DEFINE_string(
      'metric', None, 'Final-evaluation metric to rank by; default: the '
      "task's quality metric.")
  flags.DEFINE_enum('mode', None, ['min', 'max'],
                    'Whether lower or higher is better.')
  flags.DEFINE_list('set', [], 'key=value overrides for every trial.')
  flags.mark_flags_as_required(['config', 'workdir'])


if __name__ == '__main__':
  _define_flags()
  app.run(main)
