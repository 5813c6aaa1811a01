r"""Runs a config's hyperparameter sweep, one process per trial.

  python -m experiments.sweep --config=configs/<name>.py --workdir=DIR \
      [--parallel=N] [--metric=eval_loss --mode=min] [--set=key=value,...]

The config file defines `get_sweep()`, a list of override dicts (see
configs/grid.py). Each trial runs `python -m train.train` in
DIR/<trial-name>/ with its overrides (and the --set ones, for every trial).
A finished trial is not run again and an interrupted one (killed, or
stopped by a signal: status 'stopped') resumes from its checkpoint, so
re-running the command continues the sweep. Before any trial runs, every
trial's config is read and validated as train.train would, and the metric
checked: each problem is named, with exit status 2. A trial that fails is
recorded with its error and the others go on; if none finishes, the sweep
exits with status 1 and leaves the reports of an earlier sweep as they
were. A line says when each trial starts and ends, with its metric and the
best so far.

Writes DIR/leaderboard.md and DIR/leaderboard.csv (trials sorted by the
metric of their final evaluation, failures last) and DIR/sweep.png (the
metric against each swept value).

A `get_sweep()` that returns a search space (configs/search.py) runs as a
study instead (experiments/study.py):

  python -m experiments.sweep --config=FILE --workdir=DIR \
      [--study=sqlite:///DIR/study.db] [--parallel=N] [--heartbeat=60]

is one worker (N threads) of the study; start it as many times, on as many
machines, as there should be workers, with the same --study and --workdir.
"""

from collections.abc import Sequence
import concurrent.futures
import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

from absl import flags
import matplotlib
import matplotlib.ticker

from configs import search
from experiments import common
from train import cli, config_validation, metrics
from train.data import datasets
from train.errors import InputError, TrainingError, did_you_mean

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)


FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Exit status of a search's trial (experiments/trial.py) that its pruner
# stopped.
PRUNED = 3
# Exit statuses of a trial stopped by a signal before it could save (the
# signal came during its start, or twice): it resumes from its last
# checkpoint, as one stopped after saving (exit status 0) does.
INTERRUPTED = (130, -signal.SIGINT, -signal.SIGTERM)


def load_sweep(config_arg: str) -> list[dict] | search.Space:
  """The config file's get_sweep(): a grid's trials, or a search space;
  InputError for a file without one, or one that cannot be built."""
  cli.load_config(config_arg, {})  # The file exists and gives a config.
  path = config_arg.split(':', 1)[0]
  spec = importlib.util.spec_from_file_location('sweep_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_sweep'):
    raise InputError(f'--config={config_arg}: {path} defines no get_sweep() '
                     '(a list of override dicts, configs/grid.py, or a '
                     'search space, configs/search.py).')
  try:
    return module.get_sweep()
  except ValueError as error:  # A distribution or space out of its range.
    raise InputError(f'--config={config_arg}: get_sweep(): {error}') from None


def check_trials(config_arg: str, trials: list[dict], common_overrides: dict,
                 metric: str | None, mode: str | None
                 ) -> tuple[str | None, str | None]:
  """Reads and validates every trial's config, as its train.train would,
  and the metric; InputError naming every problem. Returns the metric and
  its mode (None, None: the task's quality metric, chosen afterwards)."""
  problems, config = {}, None  # Each problem, with the trials it is in.
  for trial in trials:
    try:
      config = cli.load_config(config_arg, common_overrides | trial)
      config_validation.validate(config)
    except InputError as error:
      for line in str(error).splitlines():
        problems.setdefault(line, []).append(trial_name(trial))
  if problems:
    raise InputError('\n'.join(
        problem if len(names) == len(trials) else
        f'trial {" and ".join(names)}: {problem}'
        for problem, names in problems.items()))
  if metric is None:
    return None, None
  known = metrics.final_summary(datasets.task_of(config.dataset),
                                config.decode_splits)
  if metric not in known:
    raise InputError(f'--metric={metric}: no trial logs it'
                     f'{did_you_mean(metric, known)}')
  if (mode or known[metric]) is None:
    raise InputError(f'--mode: say whether --metric={metric} is better low '
                     '(min) or high (max).')
  return metric, mode or known[metric]


def trial_name(overrides: dict) -> str:
  """'learning_rate=0.001,warmup_steps=100', safe as a directory name."""
  text = ','.join(f'{key}={value}' for key, value in overrides.items())
  return re.sub(r'[^A-Za-z0-9_.,=+-]', '_', text) or 'default'


def run_trial(config_arg: str, workdir: str, overrides: dict,
              common_overrides: dict, parallel: int = 1, *,
              module: str = 'train.train', extra: Sequence[str] = ()
              ) -> dict:
  """Runs one trial to its end (or reads its record); returns the record,
  whose status is finished, stopped (by a signal, after saving), pruned
  (`module` exited with PRUNED) or failed. `extra`: more arguments
  of `module`, not part of what the record compares."""
  command = [sys.executable, '-m', module, f'--config={config_arg}',
             f'--workdir={workdir}']
  command += [f'--config.{key}={value}'
              for key, value in (common_overrides | overrides).items()]
  record_path = os.path.join(workdir, 'trial.json')
  record = common.load_json(record_path)
  if record is not None:
    if record['command'] != command[1:]:
      raise InputError(f'{workdir} holds a trial run as '
                       f'{" ".join(record["command"])}; sweep in a new '
                       '--workdir to change the overrides.')
    if record['status'] in ('finished', 'pruned'):
      return record
  os.makedirs(workdir, exist_ok=True)
  env = dict(os.environ)
  if parallel > 1:  # Trials on one accelerator share its memory.
    env.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', f'{0.9 / parallel:.2f}')
  started = time.perf_counter()
  with open(os.path.join(workdir, 'log.txt'), 'a') as log:
    process = subprocess.run(command + list(extra), cwd=REPO, env=env,
                             stdout=log, stderr=subprocess.STDOUT)
  # Wall time of every run of the trial, an interrupted one's included.
  seconds = time.perf_counter() - started + (record or {}).get('seconds', 0)
  record = {'overrides': overrides, 'command': command[1:],
            'seconds': seconds}
  evaluations = [line for line in common.read_metrics(workdir)
                 if 'eval_loss' in line]
  # A run stopped by SIGTERM or SIGINT also exits with 0, before its end.
  config = common.load_json(os.path.join(workdir, 'config.json')) or {}
  if (process.returncode == 0 and evaluations
      and evaluations[-1]['step'] == config.get('num_train_steps')):
    record |= {'status': 'finished', 'metrics': evaluations[-1]}
  elif process.returncode == PRUNED:
    record |= {'status': 'pruned', 'metrics': evaluations[-1]}
  elif process.returncode in (0, *INTERRUPTED):
    record |= {'status': 'stopped',
               'error': 'stopped before its last step; run the sweep again '
               'to resume it'}
  else:
    with open(os.path.join(workdir, 'log.txt')) as log:
      lines = [line.strip() for line in log if line.strip()]
    record |= {'status': 'failed',
               'error': lines[-1].removeprefix('error: ') if lines else
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
  """The metric against each swept key, one panel per key, the best trial
  marked; a log axis for values spread over a decade or more, ticks at the
  values swept (up to 8 of them; integer keys at every value)."""
  figure, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5),
                              squeeze=False)
  points = [row for row in rows if 'rank' in row]
  for ax, key in zip(axes[0], keys):
    values = [row[key] for row in points]
    ax.scatter(values, [row[metric] for row in points])
    best = points[0]
    ax.scatter([best[key]], [best[metric]], s=160, facecolors='none',
               edgecolors='tab:red', label='best')
    numeric = [v for v in values if isinstance(v, (int, float))
               and not isinstance(v, bool)]
    if numeric and min(numeric) > 0 and max(numeric) >= 10 * min(numeric):
      ax.set_xscale('log')
    swept = sorted(set(numeric))
    if swept and (len(swept) <= 8 or all(isinstance(v, int) for v in swept)):
      ax.set_xticks(swept, [f'{v:g}' for v in swept])  # The values swept.
      ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set(xlabel=key, ylabel=metric)
  axes[0][0].legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def sweep(config_arg: str, workdir: str, *, parallel: int = 1,
          metric: str | None = None, mode: str | None = None,
          common_overrides: dict | None = None) -> list[dict]:
  """Runs every trial not yet finished; writes the leaderboard and plot.
  InputError, before any trial runs, for a config, override or metric
  that is wrong; TrainingError when no trial finished (the reports of an
  earlier sweep are then left as they were)."""
  common_overrides = common_overrides or {}
  trials = load_sweep(config_arg)
  if isinstance(trials, search.Space):
    raise InputError(f'--config={config_arg}: get_sweep() gives a search '
                     'space; experiments/study.py runs it.')
  names = [trial_name(trial) for trial in trials]
  if not names:
    raise InputError(f'--config={config_arg}: get_sweep() gives no trials.')
  if len(set(names)) != len(names):
    raise InputError(f'--config={config_arg}: get_sweep() gives the same '
                     'overrides twice.')
  metric, mode = check_trials(config_arg, trials, common_overrides, metric,
                              mode)
  os.makedirs(workdir, exist_ok=True)
  # Trials run from the repository root, as `python -m train.train`.
  path, sep, argument = config_arg.partition(':')
  config_arg = os.path.abspath(path) + sep + argument
  lock, best = threading.Lock(), {}

  def run(number: int, trial: dict) -> dict:
    name = trial_name(trial)
    print(f'trial {number}/{len(trials)} {name}: started', flush=True)
    record = run_trial(config_arg, os.path.join(workdir, name), trial,
                       common_overrides, parallel)
    with lock:
      if record['status'] != 'finished':
        print(f'trial {number}/{len(trials)} {name}: {record["status"]}: '
              f'{record["error"]}', flush=True)
        return record
      shown = metric or metrics.quality_metric(record['metrics'])
      direction = mode if metric else metrics.QUALITY_METRICS[shown]
      sign = 1 if direction == 'min' else -1
      value = record['metrics'].get(shown, math.nan)
      if math.isfinite(value) and (not best
                                   or sign * value < sign * best['value']):
        best.update(value=value, name=name)
      print(f'trial {number}/{len(trials)} {name}: finished, {shown} '
            f'{value:.4g} (best {best.get("value", math.nan):.4g}, '
            f'{best.get("name", "none")})', flush=True)
    return record

  with concurrent.futures.ThreadPoolExecutor(max(parallel, 1)) as pool:
    try:
      records = list(pool.map(run, range(1, len(trials) + 1), trials))
    except KeyboardInterrupt:
      # The running trials got the Ctrl-C too: they save and stop, and are
      # recorded; the trials not started yet are not.
      pool.shutdown(cancel_futures=True)
      raise
  finished = [r['metrics'] for r in records if r['status'] == 'finished']
  if not finished:
    failed = records[0]
    raise TrainingError(
        f'no trial finished; the first, {trial_name(failed["overrides"])}, '
        f'{failed["status"]}: {failed["error"]} (its log: '
        f'{os.path.join(workdir, trial_name(failed["overrides"]), "log.txt")}'
        ').')
  if metric is None:
    metric = metrics.quality_metric(finished[0])
    mode = metrics.QUALITY_METRICS[metric]
  rows = leaderboard(records, metric, mode)
  keys = list(dict.fromkeys(key for trial in trials for key in trial))
  columns = ['rank', 'trial', 'status', metric, *keys, 'error']
  table = common.write_table(
      rows, columns, os.path.join(workdir, 'leaderboard'),
      f'# Sweep of {config_arg}\n\nRanked by {metric} ({mode}imum best), '
      f'from each trial\'s final evaluation. '
      f'Machine: {common.machine_description()}.\n\n')
  if keys and any('rank' in row for row in rows):
    plot(rows, keys, metric, os.path.join(workdir, 'sweep.png'))
  print(table)
  return rows


def main(argv: list[str]) -> None:
  def work():
    common_overrides = {}
    for item in FLAGS.set:
      key, sep, value = item.partition('=')
      if not sep:
        raise InputError(f'--set item {item!r} is not key=value.')
      common_overrides[key] = value
    workdir = os.path.abspath(FLAGS.workdir)
    definition = load_sweep(FLAGS.config)
    if not isinstance(definition, search.Space):
      if FLAGS.study:
        raise InputError(f'--study: get_sweep() of {FLAGS.config} is a '
                         'grid, which runs here; a study runs a search '
                         'space (configs/search.py).')
      sweep(FLAGS.config, workdir, parallel=FLAGS.parallel,
            metric=FLAGS.metric, mode=FLAGS.mode,
            common_overrides=common_overrides)
      return
    # Imported here: it builds on this module.
    from experiments import study  # pylint: disable=import-outside-toplevel
    metric, mode = study.check(FLAGS.config, definition, common_overrides,
                               FLAGS.metric, FLAGS.mode)
    study.run(FLAGS.config, workdir, definition,
              url=FLAGS.study or f'sqlite:///{workdir}/study.db',
              name=FLAGS.study_name or os.path.basename(workdir),
              metric=metric, mode=mode, common_overrides=common_overrides,
              heartbeat=FLAGS.heartbeat, parallel=FLAGS.parallel)
  cli.run_main(argv, work)


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
                    'Whether lower or higher is better; known for the '
                    'metrics a run logs, except learning_rate and grad_norm.')
  flags.DEFINE_list('set', [], 'key=value overrides for every trial.')
  flags.DEFINE_string(
      'study', None, 'A search\'s study, shared by its workers: '
      'sqlite:///PATH or a database URL; default: sqlite:///WORKDIR/study.db.')
  flags.DEFINE_string('study_name', None, 'Name of the study in its '
                      "database; default: the workdir's name.")
  flags.DEFINE_integer('heartbeat', 60, 'Seconds between the heartbeats '
                       "of a search's running trial; one not heard from for "
                       'two is taken over by another worker.', lower_bound=1)
  flags.mark_flags_as_required(['config', 'workdir'])


if __name__ == '__main__':
  cli.run(main, _define_flags)
