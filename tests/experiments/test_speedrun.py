"""experiments/speedrun.py: a row of seeds, its statistics and whether it
is a record."""

import json
import math
import os
import signal
import sys
import threading
import time
import types

import numpy as np
import pytest
from scipy import stats

from experiments import common, speedrun, trials
from train.base.errors import InputError, TrainingError

TINY_SPEEDRUN = '''
from tests.helpers.tiny_runs import tiny_config


def get_config():
  config = tiny_config('lm_stdlib', {data_dir!r})
  config.update(num_train_steps=2, log_every=1, eval_every=2,
                checkpoint_every=2, sample_length=0)
  return config
'''


def welch(values, against):
  """Welch's t and its degrees of freedom, written out, and the one-sided
  p that `values`' mean is lower."""
  (m1, v1, n1), (m2, v2, n2) = [(np.mean(x), np.var(x, ddof=1), len(x))
                                for x in (values, against)]
  se1, se2 = v1 / n1, v2 / n2
  t = (m1 - m2) / math.sqrt(se1 + se2)
  df = (se1 + se2) ** 2 / (se1 ** 2 / (n1 - 1) + se2 ** 2 / (n2 - 1))
  return stats.t.cdf(t, df)


def row(number=1, *, values=(1.30, 1.31, 1.32), seconds=(500, 510, 520),
        corpus='a' * 64, record=True, p=None):
  return {'row': number, 'values': list(values), 'seconds': list(seconds),
          'corpus': corpus, 'record': record, 'p': p}


@pytest.mark.core
def test_the_p_value_is_welchs_one_sided_t_test():
  new, old = [1.25, 1.26, 1.24, 1.27], [1.30, 1.31, 1.29, 1.32, 1.30]
  assert speedrun.p_value(new, old, 'min') == pytest.approx(welch(new, old))
  assert speedrun.p_value(new, old, 'max') == pytest.approx(
      1 - welch(new, old))
  assert speedrun.mean_and_sd(old) == pytest.approx(
      (1.304, math.sqrt(sum((x - 1.304) ** 2 for x in old) / 4)))


@pytest.mark.core
def test_a_record_is_significant_in_time_and_on_its_records_corpus():
  first = row()
  assert speedrun.verdict(first, None, 600) == (
      True, 'a record: the first of its table')
  assert speedrun.verdict(row(2, p=0.004), first, 600) == (
      True, 'a record: p = 0.004 < 0.01 against row 1')
  assert speedrun.verdict(row(2, p=0.02), first, 600) == (
      False, 'not a record: p = 0.02 >= 0.01 against row 1')
  assert speedrun.verdict(row(2, p=0.001, seconds=(500, 601, 599)), first,
                          600) == (
      False, 'not a record: seed 1 took more than 600 s')
  assert speedrun.verdict(row(2, corpus='b' * 64), first, 600) == (
      False, 'off the track: its corpus is not that of row 1')
  assert speedrun.verdict({**row(), 'track': 'c' * 64}, None, 600) == (
      False, 'off the track: its corpus is not config.track_corpus')


@pytest.mark.core
def test_overrides_keep_the_commas_of_their_values():
  """A list flag splits at every comma; only one before a key starts an
  item."""
  assert common.parse_overrides([
      'model.attention=local', 'local', 'window_schedule=((300', ' 64)',
      ' (600', ' 128))', 'seed=3']) == {
          'model.attention': 'local,local',
          'window_schedule': '((300, 64), (600, 128))', 'seed': '3'}
  with pytest.raises(InputError, match="--set item 'seed' is not"):
    common.parse_overrides(['seed'])


@pytest.mark.core
def test_against_is_the_last_record_or_a_row_that_exists():
  rows = [row(1), row(2, record=False), row(3), row(4, record=False)]
  assert speedrun.previous_record(rows, None)['row'] == 3
  assert speedrun.previous_record(rows, 2)['row'] == 2
  assert speedrun.previous_record([], None) is None
  with pytest.raises(InputError, match=r'--against=5: the records hold rows '
                     r'1 to 4\.'):
    speedrun.previous_record(rows, 5)


@pytest.mark.core
def test_seeds_that_ran_other_configs_are_refused_naming_the_keys(tmp_path):
  """Each seed reads the config file as it starts: an edit between two
  starts is found in their config.json files; the seed alone may differ."""
  def seed_config(seed, smear):
    os.makedirs(tmp_path / f'seed={seed}')
    (tmp_path / f'seed={seed}' / 'config.json').write_text(json.dumps(
        {'seed': seed, 'model': {'smear': smear, 'd_model': 16}}))
  seed_config(0, True)
  seed_config(1, True)
  speedrun.check_one_config(str(tmp_path), 2)
  seed_config(2, False)
  with pytest.raises(TrainingError, match=r'seed 2 ran another config than '
                     r'seed 0 \(in model.smear\)'):
    speedrun.check_one_config(str(tmp_path), 3)


@pytest.mark.slow
def test_two_seeds_make_a_row_that_is_not_a_record(stdlib_dataset, data_dir,
                                                   tmp_path):
  """Two tiny runs against a record far better than they can be: their
  values are those of the seeds' runs, the statistics those computed here,
  and the row says it is no record."""
  config = tmp_path / 'tiny_speedrun.py'
  config.write_text(TINY_SPEEDRUN.format(data_dir=data_dir))
  records = tmp_path / 'records'
  records.mkdir()
  first = {**row(values=(0.5, 0.52, 0.51),
                 corpus=stdlib_dataset.corpus_sha256),
           'date': '2026-01-01', 'commit': 'abc', 'command': 'earlier',
           'metric': 'eval_bits_per_byte', 'mode': 'min', 'mean': 0.51,
           'sd': 0.01, 'steps_per_s': 2.0, 'parallel': 1,
           'machine': 'a machine', 'against': None,
           'verdict': 'a record: the first of its table'}
  common.save_json(str(records / 'records.json'), [first])
  workdir = tmp_path / 'seeds'
  new = speedrun.measure(
      str(config), str(workdir), seeds=2, parallel=2, overrides={},
      records_dir=str(records), against=None, time_limit=600,
      command='python -m experiments.speedrun --seeds=2')
  values = [common.read_metrics(str(workdir / f'seed={seed}'))[-1][
      'eval_bits_per_byte'] for seed in (0, 1)]
  assert new['values'] == values and values[0] != values[1]
  assert (new['mean'], new['sd']) == pytest.approx(
      (np.mean(values), np.std(values, ddof=1)))
  assert new['p'] == pytest.approx(welch(values, first['values']))
  assert new['corpus'] == stdlib_dataset.corpus_sha256
  assert new['row'] == 2 and new['against'] == 1 and not new['record']
  assert new['verdict'].startswith('not a record: p = ')
  assert all(0 < seconds < 600 for seconds in new['seconds'])
  with open(records / 'records.json') as f:
    assert [r['row'] for r in json.load(f)] == [1, 2]
  table = (records / 'records.md').read_text()
  assert '| 2 | ' in table and 'not a record: p = ' in table
  assert f'| {stdlib_dataset.corpus_sha256[:12]} |' in table
  assert os.path.exists(workdir / 'seed=1' / 'log.txt')
  with pytest.raises(InputError, match='has its row in'):
    speedrun.measure(
        str(config), str(workdir), seeds=2, parallel=2, overrides={},
        records_dir=str(records), against=None, time_limit=600,
        command='again')


def _soon(condition, timeout=30.0):
  """Waits for `condition()` to hold."""
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, 'it did not happen in time'
    time.sleep(0.02)


def _ended(pid: int) -> bool:
  """Whether process `pid` has ended (a zombie no one reaps has)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] == 'Z'
  except FileNotFoundError:
    return True


def _attempts(workdir) -> list[dict]:
  path = workdir / 'attempts.jsonl'
  return ([json.loads(line) for line in path.read_text().splitlines()]
          if path.exists() else [])


@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason="the parent-death signal is Linux's")
@pytest.mark.filterwarnings('ignore:os.fork')
def test_a_killed_speedruns_seed_counts_the_time_of_both_its_runs(tmp_path):
  """The speedrun (a fork of this process running seed 0, a stand-in of
  train.train that trains for 2 s: tests/helpers/fake_trial.py) is killed
  with SIGKILL a second into the seed. The seed's process gets SIGTERM,
  saves and stops; the speedrun run again resumes it. Its time is that of
  both runs by their own clocks, at most the wall time from the fork to
  the end, and over a limit that each run is within, the row is no
  record."""
  workdir = tmp_path / 'seed=0'
  run = lambda: trials.run_trial(
      'unused.py', str(workdir), {'seconds': 2.0}, {},
      module='tests.helpers.fake_trial')
  forked = time.time()
  supervisor = os.fork()
  if supervisor == 0:  # The speedrun.
    try:
      run()
    finally:
      os._exit(0)  # pylint: disable=protected-access
  _soon(lambda: (workdir / 'started').exists())
  time.sleep(1.0)
  os.kill(supervisor, signal.SIGKILL)
  os.waitpid(supervisor, 0)
  _soon(lambda: _attempts(workdir))
  assert _attempts(workdir)[0]['ended'] == 'SIGTERM'
  _soon(lambda: _ended(_attempts(workdir)[0]['pid']))

  record = run()
  ended = time.time()
  assert record['status'] == 'finished'
  first, second = _attempts(workdir)
  assert second['ended'] == 'finished'
  lives = [attempt['end'] - attempt['start'] for attempt in (first, second)]
  assert sum(lives) <= record['seconds'] <= ended - forked
  limit = (max(lives) + sum(lives)) / 2
  assert speedrun.verdict(row(seconds=[record['seconds'], 0.5]), None,
                          limit) == (
      False, f'not a record: seed 0 took more than {limit:g} s')


def test_two_speedruns_on_one_records_add_a_row_each(tmp_path, data_dir,
                                                     monkeypatch):
  """Two speedruns whose seeds run at once (each seed a stand-in: a
  finished record) end together, each slow to decide its row once it has
  read the records: both rows are kept, numbered as they were written."""
  config = tmp_path / 'tiny_speedrun.py'
  config.write_text(TINY_SPEEDRUN.format(data_dir=data_dir))
  both_running = threading.Barrier(2, timeout=30)

  def seeds(config_arg, workdir, count, parallel, overrides):
    del config_arg, parallel, overrides
    both_running.wait()
    value = 1.3 if workdir.endswith('a') else 1.2
    return [{'status': 'finished', 'seconds': 1.0,
             'metrics': {'eval_bits_per_byte': value + seed / 100}}
            for seed in range(count)]

  decide = speedrun.previous_record

  def slowly(rows, against):
    time.sleep(0.2)  # Time for the other to read the rows, if it could.
    return decide(rows, against)

  monkeypatch.setattr(speedrun, 'check_trials', lambda *args: None)
  monkeypatch.setattr(speedrun, 'run_seeds', seeds)
  monkeypatch.setattr(speedrun, 'check_one_config', lambda *args: None)
  monkeypatch.setattr(speedrun, 'previous_record', slowly)
  monkeypatch.setattr(speedrun.datasets, 'load', lambda config, workdir: (
      types.SimpleNamespace(corpus_sha256=config.track_corpus,
                            task=types.SimpleNamespace(quality_metric=(
                                lambda summary: ('eval_bits_per_byte',
                                                 'min'))))))
  records = tmp_path / 'records'
  written = {}

  def measure(name):
    written[name] = speedrun.measure(
        str(config), str(tmp_path / name), seeds=2, parallel=1,
        overrides={}, records_dir=str(records), against=None,
        time_limit=600, command=f'speedrun {name}')
  runs = [threading.Thread(target=measure, args=(name,)) for name in 'ab']
  for thread in runs:
    thread.start()
  for thread in runs:
    thread.join()
  rows = json.loads((records / 'records.json').read_text())
  assert [r['row'] for r in rows] == [1, 2]
  assert sorted(r['command'] for r in rows) == ['speedrun a', 'speedrun b']
  assert {name: r['row'] for name, r in written.items()} == {
      r['command'][-1]: r['row'] for r in rows}
  assert rows[0]['verdict'] == 'a record: the first of its table'
  assert rows[1]['against'] == 1
  table = (records / 'records.md').read_text()
  assert '| 1 | ' in table and '| 2 | ' in table
