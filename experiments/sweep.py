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
metric against each swept value, or, when the trials do not all set the
same keys, as an ablation's do, each trial's metric by name).

A `get_sweep()` that returns a search space (configs/search.py) runs as a
study instead (experiments/study.py):

  python -m experiments.sweep --config=FILE --workdir=DIR \
      [--study=sqlite:///DIR/study.db] [--parallel=N] [--heartbeat=60]

is one worker (N threads) of the study; start it as many times, on as many
machines, as there should be workers, with the same --study and --workdir.
A URL with a password is better given in the environment, ATTNLAB_STUDY
(read when --study is not given), where other users' `ps` does not show
it; the worker passes it to its trials there too, and hides it in what it
prints.
"""

import concurrent.futures
import math
import os
import threading

from absl import flags
import matplotlib
import matplotlib.ticker

from configs import search
from experiments import common, study
from experiments.trials import check_trials, load_sweep, run_trial, trial_name
from train import cli
from train.base.errors import InputError, TrainingError
from train.data import datasets

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)


FLAGS = flags.FLAGS
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


def plot_by_trial(points: list[dict], metric: str, path: str) -> None:
  """Each ranked trial's metric, by name, best at the top; a line at the
  trial without overrides, if it ranked."""
  names = [row['trial'] for row in points][::-1]
  values = [row[metric] for row in points][::-1]
  figure, ax = plt.subplots(figsize=(7, 0.8 + 0.35 * len(points)))
  ax.scatter(values, names)
  base = trial_name({})
  if base in names:
    ax.axvline(values[names.index(base)], color='tab:gray',
               linestyle='--', linewidth=1, label=base)
    ax.legend(fontsize=8)
  ax.set(xlabel=metric)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def plot(rows: list[dict], keys: list[str], metric: str, path: str) -> None:
  """The metric against each swept key, one panel per key, the best trial
  marked; a log axis for values spread over a decade or more, ticks at the
  values swept (up to 8 of them; integer keys at every value). Trials that
  do not all set the same keys (an ablation: each row its own key) are
  drawn by name instead (`plot_by_trial`)."""
  points = [row for row in rows if 'rank' in row]
  if any(key not in row for row in points for key in keys):
    plot_by_trial(points, metric, path)
    return
  figure, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5),
                              squeeze=False)
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
  task = datasets.task_of(cli.load_config(config_arg, common_overrides).dataset)
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
      shown, direction = ((metric, mode) if metric
                          else task.quality_metric(record['metrics']))
      sign = 1 if direction == 'min' else -1
      value = record['metrics'].get(shown, math.nan)
      if math.isfinite(value) and (not best
                                   or sign * value < sign * best['value']):
        best.update(value=value, name=name)
      print(f'trial {number}/{len(trials)} {name}: finished, {shown} '
            f'{value:.4g} (best {best.get("value", math.nan):.4g}, '
            f'{best.get("name", "none")})', flush=True)
    return record

  with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
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
    metric, mode = task.quality_metric(finished[0])
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
    common_overrides = common.parse_overrides(FLAGS.set)
    # Named as typed here; afterwards, with each trial's, as --config.
    cli.load_config(FLAGS.config, common_overrides, typed='--set=')
    workdir = common.local_workdir(FLAGS.workdir)
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
    metric, mode = study.check(FLAGS.config, definition, common_overrides,
                               FLAGS.metric, FLAGS.mode)
    study.run(FLAGS.config, workdir, definition,
              url=(FLAGS.study or os.environ.get(study.URL_VARIABLE)
                   or f'sqlite:///{workdir}/study.db'),
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
  flags.DEFINE_integer('parallel', 1, 'Trials run at once.', lower_bound=1)
  flags.DEFINE_string(
      'metric', None, 'Final-evaluation metric to rank by; default: the '
      "task's quality metric.")
  flags.DEFINE_enum('mode', None, ['min', 'max'],
                    'Whether lower or higher is better; known for the '
                    'metrics a run logs, except the learning rates and '
                    'grad_norm.')
  flags.DEFINE_list('set', [], 'key=value overrides for every trial.')
  flags.DEFINE_string(
      'study', None, 'A search\'s study, shared by its workers: '
      'sqlite:///PATH or a database URL; default: the environment\'s '
      f'{study.URL_VARIABLE}, else sqlite:///WORKDIR/study.db.')
  flags.DEFINE_string('study_name', None, 'Name of the study in its '
                      "database; default: the workdir's name.")
  flags.DEFINE_integer('heartbeat', 60, 'Seconds between the heartbeats '
                       "of a search's running trial; one not heard from for "
                       'two is taken over by another worker.', lower_bound=1)
  flags.mark_flags_as_required(['config', 'workdir'])


if __name__ == '__main__':
  cli.run(main, _define_flags)
