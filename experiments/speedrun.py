r"""A row of the speedrun's records: a config trained from several seeds,
its mean against the last record's, tested for significance.

  python -m experiments.speedrun --seeds=5 [--config=configs/lm_stdlib.py] \
      [--set=key=value,...] [--against=ROW] [--parallel=N] \
      [--time_limit=600] [--workdir=DIR] [--records=DIR]

Each seed k (config.seed = k) runs `python -m train.train` in DIR/seed=k/
(experiments/trials.py: a finished seed is not run again, an interrupted
one resumes), `--parallel` at once. A seed's wall time is its command's,
start-up and compilation included, summed over its runs (one whose
speedrun was killed included). The row holds the seeds' final value of
the task's quality metric (validation bits per byte for `make train`),
their mean and standard deviation, the slowest seed's wall time, the
training steps a second, and the corpus's fingerprint (train/data/
stdlib.py). It is compared with a record row (`--against`, default the
last record) by Welch's t-test, one-sided, that its mean is lower (higher
for a metric better high). The row is a record when p < 0.01 and every
seed finished within --time_limit seconds; the first row of a table is one
if its seeds did. A row on a corpus other than config.track_corpus, or
than its record's, is off the track: no record (and no p against another
corpus). A workdir gives one row: its seeds, finished by however many
invocations, and the commit the first one started on; a seed that ran
another config than the first (the file edited between their starts) is
refused, and no row written.

The rows go to RECORDS/records.json (each seed's value, for later tests;
a row may carry a `note` in words) and RECORDS/records.md (the table),
every row whether a record or not. A row is numbered, and compared with
the last record, as it is written, under RECORDS/lock (the workdir lock
of train/run/workdir.py): speedruns that end together each add theirs.
"""

import concurrent.futures
import contextlib
import datetime
import math
import os
import subprocess
import sys
import time

from absl import flags
import numpy as np
from scipy import stats

from experiments import common
from experiments.trials import REPO, check_trials, run_trial
from train import cli
from train.base.errors import InputError, TrainingError
from train.base.train_config import TrainConfig
from train.data import datasets
from train.run import metrics
from train.run import workdir as workdir_lib

FLAGS = flags.FLAGS
RECORDS = 'experiments/results/speedrun'
# The significance a record needs, as the GPT-2 speedrun asks.
P_RECORD = 0.01
COLUMNS = ('row', 'date', 'commit', 'command', 'corpus', 'seeds',
           'metric (mean ± sd)', 'slowest seed', 'steps/s', 'p', 'record')
# Seconds a speedrun waits for another's write of the records (moments).
RECORDS_WAIT_S = 60.0


def mean_and_sd(values: list[float]) -> tuple[float, float]:
  """The mean and the sample standard deviation (n - 1)."""
  return float(np.mean(values)), float(np.std(values, ddof=1))


def p_value(values: list[float], against: list[float], mode: str) -> float:
  """Welch's t-test, one-sided: the chance of a mean this much better
  (lower for mode 'min') than `against`'s if it were not better."""
  return float(stats.ttest_ind(
      values, against, equal_var=False,
      alternative='less' if mode == 'min' else 'greater').pvalue)


def verdict(row: dict, record: dict | None, time_limit: float
            ) -> tuple[bool, str]:
  """Whether `row` is a record against `record` (the row it is compared
  with, or None for the first of a table), and why in words."""
  slow = [seed for seed, seconds in enumerate(row['seconds'])
          if seconds > time_limit]
  if slow:
    return False, (f'not a record: seed {", ".join(map(str, slow))} took '
                   f'more than {time_limit:g} s')
  if row.get('track') and row['corpus'] != row['track']:
    return False, 'off the track: its corpus is not config.track_corpus'
  if record is None:
    return True, 'a record: the first of its table'
  if row['corpus'] != record['corpus']:
    return False, (f'off the track: its corpus is not that of row '
                   f'{record["row"]}')
  if row['p'] < P_RECORD:
    return True, f'a record: p = {row["p"]:.2g} < {P_RECORD} against row ' \
                 f'{record["row"]}'
  return False, (f'not a record: p = {row["p"]:.2g} >= {P_RECORD} against '
                 f'row {record["row"]}')


def previous_record(rows: list[dict], against: int | None) -> dict | None:
  """The row a new one is compared with: row `against` (1-based), or the
  last record; InputError naming --against for a row not there."""
  if against is None:
    records = [row for row in rows if row['record']]
    return records[-1] if records else None
  if not 1 <= against <= len(rows):
    raise InputError(f'--against={against}: the records hold rows 1 to '
                     f'{len(rows)}.' if rows else
                     f'--against={against}: the records hold no rows yet.')
  return rows[against - 1]


def _commit() -> str:
  """The checked-out commit, '+changes' where tracked files differ."""
  def git(*args):
    return subprocess.run(['git', *args], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
  try:
    changed = git('status', '--porcelain', '--untracked-files=no')
    return git('rev-parse', '--short', 'HEAD') + ('+changes' if changed
                                                  else '')
  except (OSError, subprocess.CalledProcessError):
    return 'unknown'


def _first_commit(workdir: str) -> str:
  """The commit the seeds of `workdir` started on: this one, recorded in
  workdir/speedrun.json for the seeds a later invocation finishes."""
  path = os.path.join(workdir, 'speedrun.json')
  started = common.load_json(path)
  if started is None:
    os.makedirs(workdir, exist_ok=True)
    started = {'commit': _commit()}
    common.save_json(path, started)
  return started['commit']


def _steps_per_s(workdir: str) -> float:
  """The training steps a second of a seed's last logged training line."""
  logged = [line['steps_per_s'] for line in common.read_metrics(workdir)
            if 'steps_per_s' in line]
  return logged[-1] if logged else math.nan


def run_seeds(config_arg: str, workdir: str, seeds: int, parallel: int,
              overrides: dict) -> list[dict]:
  """Each seed's trial record (experiments/trials.py), in seed order;
  TrainingError naming the first seed that did not finish."""
  def run(seed: int) -> dict:
    print(f'seed {seed}: started', flush=True)
    record = run_trial(config_arg, os.path.join(workdir, f'seed={seed}'),
                       {'seed': seed}, overrides, parallel)
    print(f'seed {seed}: {record["status"]} in {record["seconds"]:.0f} s',
          flush=True)
    return record
  with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
    records = list(pool.map(run, range(seeds)))
  for seed, record in enumerate(records):
    if record['status'] != 'finished':
      raise TrainingError(
          f'seed {seed} {record["status"]}: {record.get("error")} (its log: '
          f'{os.path.join(workdir, f"seed={seed}", "log.txt")}).')
  return records


def check_one_config(workdir: str, seeds: int) -> None:
  """TrainingError naming the keys where a seed ran another config than
  seed 0's (its seed aside): each seed reads the config file as it starts,
  so an edit of it (or of a default) between their starts splits the row."""
  def config(seed: int) -> dict:
    return metrics.flat_hparams(
        workdir_lib.run_config(os.path.join(workdir, f'seed={seed}')))
  first = config(0)
  for seed in range(1, seeds):
    other = config(seed)
    differing = sorted(key for key in first.keys() | other.keys()
                       if key != 'seed' and first.get(key) != other.get(key))
    if differing:
      raise TrainingError(
          f'seed {seed} ran another config than seed 0 (in '
          f'{", ".join(differing)}): the config changed between their '
          'starts; measure again in a new --workdir.')


@contextlib.contextmanager
def _locked(records_dir: str):
  """Holds `records_dir`/lock meanwhile, once another speedrun lets go."""
  os.makedirs(records_dir, exist_ok=True)
  deadline = time.monotonic() + RECORDS_WAIT_S
  while True:
    try:
      lock = workdir_lib.Lock(records_dir)
      break
    except InputError:  # Held.
      if time.monotonic() > deadline:
        raise TrainingError(
            f'{records_dir}/lock was held for {RECORDS_WAIT_S:g} s; the row '
            'is not written: run the same command again to add it.'
            ) from None
      time.sleep(0.1)
  try:
    yield
  finally:
    lock.release()


def _rows(records_dir: str, workdir: str) -> list[dict]:
  """The rows of the records; InputError if `workdir` has one already."""
  rows = common.load_json(os.path.join(records_dir, 'records.json')) or []
  if any(row.get('workdir') == workdir for row in rows):
    raise InputError(f'--workdir={workdir} has its row in {records_dir} '
                     'already; measure again in a new --workdir.')
  return rows


def measure(config_arg: str, workdir: str, *, seeds: int, parallel: int,
            overrides: dict, records_dir: str, against: int | None,
            time_limit: float, command: str) -> dict:
  """Runs the seeds, then adds their row to the records (records.json and
  records.md in `records_dir`) and returns it."""
  if seeds < 2:
    raise InputError(f'--seeds={seeds}: a standard deviation and a t-test '
                     'need 2 or more.')
  workdir = os.path.abspath(workdir)
  previous_record(_rows(records_dir, workdir), against)  # Before the seeds.
  check_trials(config_arg, [{'seed': seed} for seed in range(seeds)],
               overrides, None, None)
  config = TrainConfig.from_config(cli.load_config(config_arg, overrides))
  # The seeds run from the repository root, as `python -m train.train`.
  path, sep, argument = config_arg.partition(':')
  config_arg = os.path.abspath(path) + sep + argument
  # Built once here, before the seeds start.
  dataset = datasets.load(config, workdir)
  commit = _first_commit(workdir)
  trials = run_seeds(config_arg, workdir, seeds, parallel, overrides)
  check_one_config(workdir, seeds)
  metric, mode = dataset.task.quality_metric(trials[0]['metrics'])
  values = [trial['metrics'][metric] for trial in trials]
  mean, sd = mean_and_sd(values)
  steps_per_s = float(np.mean([_steps_per_s(
      os.path.join(workdir, f'seed={seed}')) for seed in range(seeds)]))
  with _locked(records_dir):  # Read, numbered and written as one.
    rows = _rows(records_dir, workdir)
    record = previous_record(rows, against)
    row = {
        'row': len(rows) + 1, 'date': datetime.date.today().isoformat(),
        'commit': commit, 'command': command, 'workdir': workdir,
        'corpus': dataset.corpus_sha256, 'metric': metric, 'mode': mode,
        'values': values, 'mean': mean, 'sd': sd,
        'seconds': [trial['seconds'] for trial in trials],
        'steps_per_s': steps_per_s,
        'parallel': parallel, 'machine': common.machine_description(),
        'against': record and record['row'],
        'track': config.track_corpus or None,
        'p': (p_value(values, record['values'], mode)
              if record and record['corpus'] == dataset.corpus_sha256
              else None)}
    row['record'], row['verdict'] = verdict(row, record, time_limit)
    common.save_json(os.path.join(records_dir, 'records.json'),
                     rows + [row])
    write_table(rows + [row], records_dir)
  return row


def _cells(row: dict) -> dict:
  return {
      'row': row['row'], 'date': row['date'], 'commit': row['commit'],
      'command': f'`{row["command"]}`',
      'corpus': (row['corpus'] or 'none')[:12],
      'seeds': f'{len(row["values"])} ({row["parallel"]} at once)',
      'metric (mean ± sd)': f'{row["metric"]} {row["mean"]:.4f} ± '
                            f'{row["sd"]:.4f}',
      'slowest seed': f'{max(row["seconds"]):.0f} s',
      'steps/s': f'{row["steps_per_s"]:.3g}',
      'p': ('' if row['p'] is None else
            f'{row["p"]:.2g} (row {row["against"]})'),
      'record': row['verdict']}


def write_table(rows: list[dict], records_dir: str) -> None:
  """records.md: a line per row, each seed's value below the table."""
  lines = ['| ' + ' | '.join(COLUMNS) + ' |', '|' + '---|' * len(COLUMNS)]
  lines += ['| ' + ' | '.join(str(_cells(row)[c]) for c in COLUMNS) + ' |'
            for row in rows]
  seeds = [f'- row {row["row"]}: ' + ', '.join(
      f'{value:.4f} ({seconds:.0f} s)'
      for value, seconds in zip(row['values'], row['seconds']))
           + f'; {row["machine"]}.' + (f' {row["note"]}' if 'note' in row
                                       else '') for row in rows]
  with open(os.path.join(records_dir, 'records.md'), 'w') as f:
    f.write('# Speedrun records\n\nWritten by `python -m experiments.'
            'speedrun` (its docstring says how a row is measured and when it '
            f'is a record: p < {P_RECORD}, one-sided Welch t-test, every seed '
            'within the time limit). The corpus is its sha256\'s first 12 hex '
            'digits.\n\n' + '\n'.join(lines)
            + '\n\nEach seed\'s value and wall time:\n\n' + '\n'.join(seeds)
            + '\n')


def main(argv: list[str]) -> None:
  def work():
    overrides = common.parse_overrides(FLAGS.set)
    cli.load_config(FLAGS.config, overrides, typed='--set=')
    row = measure(
        FLAGS.config, common.local_workdir(FLAGS.workdir or
                                           common.results_folder(None,
                                                                 'speedrun')),
        seeds=FLAGS.seeds, parallel=FLAGS.parallel, overrides=overrides,
        records_dir=FLAGS.records, against=FLAGS.against,
        time_limit=FLAGS.time_limit,
        # As typed: absl has taken the flags out of argv.
        command=' '.join(['python -m experiments.speedrun', *sys.argv[1:]]))
    print(f'Row {row["row"]}: {row["metric"]} {row["mean"]:.4f} ± '
          f'{row["sd"]:.4f} over {len(row["values"])} seeds, slowest '
          f'{max(row["seconds"]):.0f} s: {row["verdict"]}. '
          f'{FLAGS.records}/records.md holds it.')
  cli.run_main(argv, work)


def _define_flags() -> None:
  """The command line, defined only when this runs as a script."""
  flags.DEFINE_string('config', 'configs/lm_stdlib.py',
                      'Config file, optionally with :argument.')
  flags.DEFINE_list('set', [], 'key=value overrides of the config.')
  flags.DEFINE_integer('seeds', 5, 'Seeds to run (0 to N - 1).')
  flags.DEFINE_integer('parallel', 1, 'Seeds run at once.', lower_bound=1)
  flags.DEFINE_integer('against', None, 'The row (1-based) to test against; '
                       'default: the last record.')
  flags.DEFINE_float('time_limit', 600.0,
                     'Seconds within which every seed must finish.')
  flags.DEFINE_string('workdir', None, "The seeds' directory; default: a "
                      'fresh folder workdirs/speedrun-<date>-<time>.')
  flags.DEFINE_string('records', RECORDS,
                      'The folder of records.json and records.md.')


if __name__ == '__main__':
  _define_flags()
  cli.run(main)
