"""The report of a search sweep's study (experiments/study.py).

Writes, in the sweep's workdir:
  leaderboard.md / .csv  every trial, latest attempt: finished ones ranked
                         by the metric, then pruned ones (by the last value
                         they reported), then the running, waiting and
                         failed ones, with the best configuration as a
                         command line;
  params.png             the metric against each key, a log axis for the
                         log-scaled ones, pruned trials at their last value,
                         the best circled;
  history.png            each trial's metric by trial number with the best
                         so far, and the learning curves (the metric at
                         every evaluation) of the top trials over the rest.
"""

import math
import os
import shlex

import matplotlib
import optuna

from configs import search
from experiments import common

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)

STATES = {'COMPLETE': 'finished', 'PRUNED': 'pruned', 'FAIL': 'failed',
          'RUNNING': 'running', 'WAITING': 'waiting'}
TOP = 5  # Learning curves drawn in colour.


def rows(trials: dict[str, optuna.trial.FrozenTrial], space: search.Space,
         sweep: dict, workdir: str) -> list[dict]:
  """One row per trial directory (`trials`: the latest attempt of each),
  best first (see the module docstring)."""
  metric, sign = sweep['metric'], 1 if sweep['mode'] == 'min' else -1
  rows = []
  for name, trial in trials.items():
    record = common.load_json(os.path.join(workdir, name, 'trial.json')) or {}
    status = STATES[trial.state.name]
    error = ''  # Of the trial's last run, if that run failed.
    if status == 'failed' and record.get('status') == 'failed':
      error = record['error']
    elif status == 'failed' and record.get('status') == 'finished':
      error = f'{metric} is {record["metrics"].get(metric)}'
    # The last evaluation: the final one (the value told to the study), or
    # where the pruner stopped it (the last value reported).
    value = step = None
    if status == 'finished':
      value, step = trial.value, record.get('metrics', {}).get('step')
    elif status == 'pruned' and trial.intermediate_values:
      # Reported at fractions of the trial's steps (study.budget_point):
      # its last evaluation's step and value are in its record.
      value = record.get('metrics', {}).get(
          metric, trial.intermediate_values[max(trial.intermediate_values)])
      step = record.get('metrics', {}).get('step')
    rows.append({'trial': name, 'status': status, metric: value,
                 # A trial waiting to resume has its values fixed only.
                 'step': step, **{key: (trial.params or trial.system_attrs.get(
                     'fixed_params', {})).get(key) for key in space.space},
                 'seconds': record.get('seconds'),
                 'error': error})
  order = {'finished': 0, 'pruned': 1, 'running': 2, 'waiting': 3,
           'failed': 4}
  rows.sort(key=lambda row: (order[row['status']],
                             sign * row[metric] if row[metric] is not None
                             else 0, row['trial']))
  for rank, row in enumerate(r for r in rows if r['status'] == 'finished'):
    row['rank'] = rank + 1
  return rows


def best_command(sweep: dict, row: dict, space: search.Space) -> str:
  """The command that trains the best trial's configuration alone."""
  overrides = sweep['overrides'] | space.overrides(
      {key: row[key] for key in space.space})
  return shlex.join(['python', '-m', 'train.train',
                     f'--config={sweep["config"]}',
                     f'--workdir=workdirs/{row["trial"]}']
                    + [f'--config.{key}={value}'
                       for key, value in overrides.items()])


def plot_params(rows: list[dict], space: search.Space, metric: str,
                path: str) -> None:
  """The metric against each key, one panel per key."""
  keys = list(space.space)
  figure, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4),
                              squeeze=False, sharey=True)
  for ax, key in zip(axes[0], keys):
    distribution = space.space[key]
    position = ({value: i for i, value in enumerate(distribution.values)}
                if isinstance(distribution, search.Choice) else None)
    for status, style in (('finished', dict(marker='o', color='tab:blue')),
                          ('pruned', dict(marker='x', color='tab:gray'))):
      shown = [row for row in rows if row['status'] == status
               and row[metric] is not None]
      x = [position[row[key]] if position else row[key] for row in shown]
      ax.scatter(x, [row[metric] for row in shown], label=status, **style)
    best = next((row for row in rows if row.get('rank') == 1), None)
    if best:
      ax.scatter([position[best[key]] if position else best[key]],
                 [best[metric]], s=160, facecolors='none',
                 edgecolors='tab:red', label='best')
    if position:
      labels = [str(v) for v in position]
      slanted = sum(map(len, labels)) > 30  # Long names (presets) slant.
      ax.set_xticks(range(len(position)), labels,
                    rotation=30 if slanted else 0,
                    ha='right' if slanted else 'center')
    elif distribution.log:
      # The space's range, with matplotlib's 5% margins: a log axis needs
      # limits even before any trial has a value to show.
      margin = (distribution.high / distribution.low) ** 0.05
      ax.set_xscale('log')
      ax.set_xlim(distribution.low / margin, distribution.high * margin)
    ax.set(xlabel=key)
  axes[0][0].set_ylabel(metric)
  axes[0][0].legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def plot_history(rows: list[dict], metric: str, mode: str, workdir: str,
                 path: str) -> None:
  """Left: each trial's metric by trial number, the best so far as a
  line. Right: the metric at each evaluation of every trial, the TOP
  finished ones in colour."""
  figure, (history, curves) = plt.subplots(1, 2, figsize=(10, 3.6))
  number = {row['trial']: int(row['trial'].rsplit('-', 1)[1])
            for row in rows}
  for status, style in (('finished', dict(marker='o', color='tab:blue')),
                        ('pruned', dict(marker='x', color='tab:gray'))):
    shown = sorted((number[row['trial']], row[metric]) for row in rows
                   if row['status'] == status and row[metric] is not None)
    history.scatter([n for n, _ in shown], [v for _, v in shown],
                    label=status, **style)
  finished = sorted((number[row['trial']], row[metric]) for row in rows
                    if row['status'] == 'finished')
  best, line = None, []
  for n, value in finished:
    best = value if best is None else (min if mode == 'min' else max)(
        best, value)
    line.append((n, best))
  if line:
    history.step([n for n, _ in line], [v for _, v in line], where='post',
                 color='tab:red', label='best so far')
  history.set(xlabel='trial', ylabel=metric)
  history.legend(fontsize=8)
  top = [row['trial'] for row in rows if row.get('rank', math.inf) <= TOP]
  for row in rows:
    points = [(line['step'], line[metric]) for line in
              common.read_metrics(os.path.join(workdir, row['trial']))
              if metric in line]
    if not points:
      continue
    steps, values = zip(*points)
    if row['trial'] in top:
      curves.plot(steps, values, marker='.', label=row['trial'], zorder=2)
    else:
      # Marked: a trial pruned at its first evaluation is one point.
      curves.plot(steps, values, marker='.', color='lightgray', zorder=1)
  curves.set(xlabel='step', ylabel=metric,
             title=f'top {len(top)} in colour, the others grey')
  if curves.get_legend_handles_labels()[0]:
    curves.legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def wall_time(attempts: list[optuna.trial.FrozenTrial]) -> str:
  """From the first attempt's start to the last one's end, and the
  attempts' own times added up, as the study recorded them."""
  ended = [t for t in attempts if t.datetime_complete and t.datetime_start]
  if not ended:
    return 'no trial has ended'
  span = (max(t.datetime_complete for t in ended)
          - min(t.datetime_start for t in ended)).total_seconds()
  own = sum((t.datetime_complete - t.datetime_start).total_seconds()
            for t in ended)
  return (f'{span / 60:.0f} min from the first trial\'s start to the last '
          f'one\'s end; the trials took {own / 60:.0f} min together')


def _tally(table_rows: list[dict], sweep: dict) -> str:
  """'6 of 8 trials (5 finished, 1 pruned)'."""
  counts = {}
  for row in table_rows:
    counts[row['status']] = counts.get(row['status'], 0) + 1
  return (f'{len(table_rows)} of {sweep["trials"]} trials ('
          + ', '.join(f'{n} {status}' for status, n in counts.items()) + ')')


def _best(table_rows: list[dict]) -> dict | None:
  return next((row for row in table_rows if row.get('rank') == 1), None)


def summary(table_rows: list[dict], sweep: dict, workdir: str) -> str:
  """The line a worker ends with: the study's trials, the best, and where
  the report is."""
  metric, best = sweep['metric'], _best(table_rows)
  return (f'Search: {_tally(table_rows, sweep)}'
          + (f'; best {metric} {best[metric]:.4g} ({best["trial"]})'
             if best else '')
          + f'; report in {os.path.join(workdir, "leaderboard.md")}.')


def write(trials: dict[str, optuna.trial.FrozenTrial], space: search.Space,
          sweep: dict, workdir: str, command: str, wall: str) -> list[dict]:
  """Writes the report of `trials` (rows()) in `workdir`, run by each
  worker's `command` in `wall` time (wall_time()); returns its rows."""
  metric, mode = sweep['metric'], sweep['mode']
  table_rows = rows(trials, space, sweep, workdir)
  best = _best(table_rows)
  header = (
      f'# Search sweep of {sweep["config"]}\n\n'
      f'{_tally(table_rows, sweep)}'
      + f', ranked by {metric} ({mode}imum best) from each trial\'s final '
      'evaluation; a pruned trial shows the last value it reported, at '
      f'`step`. Machine: {common.machine_description()}.\n\n'
      f'Each worker: `{command}`. Wall time: {wall}.\n\n'
      'Search space: ' + '; '.join(f'`{key}` {text}' for key, text in
                                   space.describe().items())
      + f'. Sampler {space.sampler}, pruner {space.pruner}.\n\n'
      + (f'Best ({best["trial"]}, {metric} {best[metric]:.4g}):\n\n'
         f'    {best_command(sweep, best, space)}\n\n' if best else ''))
  columns = ['rank', 'trial', 'status', metric, 'step', *space.space,
             'seconds', 'error']
  common.write_table(table_rows, columns,
                     os.path.join(workdir, 'leaderboard'), header)
  plot_params(table_rows, space, metric,
              os.path.join(workdir, 'params.png'))
  plot_history(table_rows, metric, mode, workdir,
               os.path.join(workdir, 'history.png'))
  return table_rows
