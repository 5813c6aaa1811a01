"""experiments/sweep.py and experiments/trials.py: grids of trials, their
leaderboard and their checks; configs/grid.py and configs/search.py."""

import os
import pathlib

import pytest

from configs import grid, lm_ablation, lm_stdlib
from experiments import common, study, sweep, trials
from tests.helpers import REPO
from tests.helpers.fake_trial import exiting
from tests.helpers.tiny_runs import TINY_LISTOPS
from train.base.errors import InputError, TrainingError

PNG = b'\x89PNG'


SWEEP_CONFIG = TINY_LISTOPS + '''

def get_sweep():
  # The last trial fails as it runs: its data_dir cannot be made.
  return grid.zipped(learning_rate=[1e-3, 3e-3, 1e-3],
                     data_dir=[{data_dir!r}, {data_dir!r}, '/dev/null/data'])
'''


def sweep_config(data_dir, tmp_path) -> pathlib.Path:
  """SWEEP_CONFIG written to a file in `tmp_path`."""
  config_path = tmp_path / 'sweep_config.py'
  config_path.write_text(SWEEP_CONFIG.format(
      data_dir=data_dir, steps=4, log_every=2, eval_every=4,
      checkpoint_every=4))
  return config_path


def test_sweep_records_a_failure_and_skips_finished_trials(data_dir,
                                                           tmp_path):
  config_path = sweep_config(data_dir, tmp_path)
  workdir = str(tmp_path / 'sweep')
  rows = sweep.sweep(str(config_path), workdir, parallel=2)
  assert [row['status'] for row in rows] == ['finished', 'finished', 'failed']
  assert [row['rank'] for row in rows[:2]] == [1, 2]
  assert rows[2]['error'].startswith(
      "config.data_dir='/dev/null/data' cannot hold the dataset: ")
  board = open(os.path.join(workdir, 'leaderboard.md')).read()
  assert 'failed' in board and 'learning_rate' in board
  with open(os.path.join(workdir, 'sweep.png'), 'rb') as f:
    assert f.read(4) == PNG

  finished = os.path.join(workdir, trials.trial_name(
      {'learning_rate': 1e-3, 'data_dir': data_dir}), 'trial.json')
  before = os.path.getmtime(finished)
  again = sweep.sweep(str(config_path), workdir, parallel=2)
  assert os.path.getmtime(finished) == before  # Not run again.
  assert [row['status'] for row in again] == ['finished', 'finished',
                                              'failed']


@pytest.mark.core
def test_an_ablations_trials_are_plotted_by_name(tmp_path):
  """Rows that set different keys (the default, then one key each): no
  key has a value in every row."""
  rows = [{'rank': 1, 'trial': 'b=2', 'loss': 1.2, 'b': 2},
          {'rank': 2, 'trial': 'default', 'loss': 1.3},
          {'rank': 3, 'trial': 'a=1', 'loss': 1.4, 'a': 1},
          {'trial': 'a=3', 'status': 'failed', 'a': 3}]
  path = str(tmp_path / 'sweep.png')
  sweep.plot(rows, ['a', 'b'], 'loss', path)
  with open(path, 'rb') as f:
    assert f.read(4) == PNG


def failing(command, options):
  """What a trial's train.train leaves when it fails at once."""
  del command
  options['stdout'].write('error: boom\n')


def test_a_sweep_with_no_finished_trial_fails_and_keeps_the_reports(
    data_dir, tmp_path, monkeypatch):
  config_path = sweep_config(data_dir, tmp_path)
  workdir = tmp_path / 'sweep'
  workdir.mkdir()
  (workdir / 'leaderboard.md').write_text('an earlier sweep')
  monkeypatch.setattr(trials.subprocess, 'Popen', exiting(1, failing))
  with pytest.raises(TrainingError, match='no trial finished; the first, '
                     r'.*, failed: boom \(its log: '):
    sweep.sweep(str(config_path), str(workdir))
  assert (workdir / 'leaderboard.md').read_text() == 'an earlier sweep'
  assert not (workdir / 'leaderboard.csv').exists()


def test_a_sweep_refuses_a_metric_before_any_trial(data_dir, tmp_path,
                                                   monkeypatch):
  config_path = sweep_config(data_dir, tmp_path)

  def refuse(*args, **kwargs):
    raise AssertionError('a trial ran')
  monkeypatch.setattr(trials.subprocess, 'Popen', refuse)
  with pytest.raises(InputError, match='--metric=eval_acc: no trial logs '
                     'it; did you mean eval_accuracy'):
    sweep.sweep(str(config_path), str(tmp_path / 'sweep'), metric='eval_acc')
  with pytest.raises(InputError, match='--mode: say whether --metric='
                     'grad_norm is better low'):
    sweep.sweep(str(config_path), str(tmp_path / 'sweep'),
                metric='grad_norm')
  assert not (tmp_path / 'sweep').exists()


def test_a_trial_stopped_by_a_signal_is_not_finished(tmp_path, monkeypatch):
  workdir = str(tmp_path / 'trial')

  def stopped_at_step_5(command, options):
    # What train.train leaves after SIGTERM at step 5 of 10: exit status 0.
    del command, options
    common.save_json(os.path.join(workdir, 'config.json'),
                     {'num_train_steps': 10})
    with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
      f.write('{"step": 5, "eval_loss": 1.0}\n')

  monkeypatch.setattr(trials.subprocess, 'Popen',
                      exiting(0, stopped_at_step_5))
  record = trials.run_trial('configs/listops.py', workdir, {}, {})
  assert record['status'] == 'stopped'
  assert 'run the sweep again' in record['error']


@pytest.mark.core
def test_leaderboard_ranks_by_the_metric_and_lists_failures_last():
  def record(rate, status='finished', value=None):
    record = {'overrides': {'learning_rate': rate}, 'status': status}
    if status == 'finished':
      record['metrics'] = {'eval_loss': value}
    else:
      record['error'] = 'boom'
    return record

  records = [record(1, value=2.0), record(2, 'failed'),
             record(3, value=float('nan')), record(4, value=1.0)]
  low = sweep.leaderboard(records, 'eval_loss', 'min')
  assert [row['trial'] for row in low] == [
      'learning_rate=4', 'learning_rate=1', 'learning_rate=2',
      'learning_rate=3']
  assert [row.get('rank') for row in low] == [1, 2, None, None]
  assert low[2]['error'] == 'boom' and low[3]['error'] == 'eval_loss is nan'
  high = sweep.leaderboard(records, 'eval_loss', 'max')
  assert [row['trial'] for row in high[:2]] == ['learning_rate=1',
                                                'learning_rate=4']


def test_grid_helpers():
  assert grid.product(a=[1, 2], b=['x']) == [{'a': 1, 'b': 'x'},
                                              {'a': 2, 'b': 'x'}]
  assert grid.zipped(a=[1, 2], b=[3, 4]) == [{'a': 1, 'b': 3},
                                             {'a': 2, 'b': 4}]
  with pytest.raises(ValueError, match='one length'):
    grid.zipped(a=[1], b=[1, 2])


def test_listops_config_defines_a_search_valid_at_every_bound():
  config = str(REPO / 'configs' / 'listops.py')
  space = trials.load_sweep(config + ':full')
  assert set(space.space) == {'learning_rate', 'warmup_steps',
                              'model.dropout_rate'}
  assert study.check(config, space, {}, None, None) == ('eval_accuracy',
                                                        'max')


def test_the_speedrun_search_and_its_ablation_are_valid():
  """The third search at every bound, from `:round2`; the second search's
  ablation: its winner, then each option alone at its other value."""
  config = str(REPO / 'configs' / 'lm_stdlib.py') + ':round2'
  space = trials.load_sweep(config)
  assert study.check(config, space, {}, None, None) == (
      'eval_bits_per_byte', 'min')
  ablation = str(REPO / 'configs' / 'lm_ablation.py')
  rows = trials.load_sweep(ablation)
  options = rows[1:-len(lm_ablation.SEEDS)]
  assert rows[0] == {} and [len(row) for row in options] == [1] * len(
      lm_stdlib.OPTIONS)
  assert [key for row in options for key in row] == list(lm_stdlib.OPTIONS)
  assert rows[len(options) + 1:] == [{'seed': s} for s in lm_ablation.SEEDS]
  trials.check_trials(ablation, rows, {}, None, None)
