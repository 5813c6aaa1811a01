"""A workdir belongs to one run and one config: a second run is refused,
a killed run's lock is taken over, a resume may change only how the run is
observed, stopped or laid out."""

import json
import os

import pytest

from tests.helpers.tiny_runs import tiny_config
from train import cli
from train.base import storage
from train.base.errors import InputError
from train.run import workdir
from train.run.trainer import train_and_evaluate


def exit_status(config, path) -> int:
  """The status train.train exits with (it fails before any data is read
  here)."""
  with pytest.raises(SystemExit) as exit_info:
    cli.outcome(lambda: train_and_evaluate(config, path))
  return exit_info.value.code


def a_recorded_run(data_dir, path):
  """The config of a run that claimed `path` and logged a step there."""
  config = tiny_config('lm_stdlib', data_dir)
  with workdir.claim(config, str(path)):
    pass
  with open(os.path.join(path, 'metrics.jsonl'), 'w') as f:
    f.write('{"step": 1, "loss": 1.0}\n')
  return config


def test_a_second_run_on_a_locked_workdir_exits_2_naming_the_holder(
    data_dir, tmp_path, capsys):
  lock = workdir.Lock(str(tmp_path))
  try:
    assert exit_status(tiny_config('lm_stdlib', data_dir), str(tmp_path)) == 2
  finally:
    lock.release()
  error = capsys.readouterr().err
  assert f'in use by the run of pid {os.getpid()}' in error
  assert error.count('\n') == 1
  assert not os.path.exists(tmp_path / 'config.json')


def test_a_killed_runs_lock_is_taken_over_with_a_warning(tmp_path, capsys):
  with open(tmp_path / 'lock', 'w') as f:
    f.write(json.dumps({'host': 'node7', 'pid': 4242,
                        'since': '2026-01-01T00:00:00'}))
  lock = workdir.Lock(str(tmp_path))
  assert 'taking over' in capsys.readouterr().out
  with open(tmp_path / 'lock') as f:
    assert json.load(f)['pid'] == os.getpid()
  lock.release()
  assert (tmp_path / 'lock').read_text() == ''
  workdir.Lock(str(tmp_path)).release()  # Released: no warning now.
  assert 'taking over' not in capsys.readouterr().out


def test_on_an_object_store_a_renewed_lock_refuses_a_killed_one_is_taken(
    data_dir, object_store, tmp_path, monkeypatch, capsys):
  """The lease (workdir.LeaseLock), on a short one: a live holder renews
  its lock, so a second run stops naming it; a killed run's lock is taken
  over once a lease has passed; a released one is taken at once."""
  monkeypatch.setattr(workdir, 'LEASE_S', 0.4)
  path = f'{object_store}/{tmp_path.name}'
  config = tiny_config('lm_stdlib', data_dir)
  held = workdir.LeaseLock(path)
  try:
    assert exit_status(config, path) == 2
  finally:
    held.release()
  error = capsys.readouterr().err
  assert f'in use by the run of pid {os.getpid()}' in error
  assert not storage.path(f'{path}/config.json').exists()

  killed = {'host': 'node7', 'pid': 4242, 'since': '2026-01-01T00:00:00'}
  storage.write_whole(storage.path(f'{path}/lock'), json.dumps(killed))
  with workdir.claim(config, path):
    out = capsys.readouterr().out
    assert 'watching it for up to 0.4 s' in out
    assert ('taking over ' f'{path}/lock from the run of pid 4242 on node7'
            in out)
    assert json.loads(storage.path(f'{path}/lock').read_text())['pid'] == (
        os.getpid())
    assert storage.path(f'{path}/config.json').exists()
  assert not storage.path(f'{path}/lock').exists()
  with workdir.claim(config, path):  # Released: taken at once.
    pass
  storage.write_whole(storage.path(f'{path}/lock'), '')  # A disk's release.
  with workdir.claim(config, path):
    pass
  assert capsys.readouterr().out == ''

  assert exit_status(config, 'gs://no-such-bucket/run') == 2
  assert capsys.readouterr().err.startswith(
      'error: --workdir=gs://no-such-bucket/run: the bucket '
      'gs://no-such-bucket does not exist')
  assert exit_status(config, 's3://bucket/run') == 2
  assert capsys.readouterr().err.startswith(
      'error: --workdir=s3://bucket/run: s3:// is not an object store a run '
      'can use; gs:// is.')


@pytest.mark.core
def test_a_resume_with_a_changed_model_key_exits_2_and_keeps_config_json(
    data_dir, tmp_path, capsys):
  config = a_recorded_run(data_dir, tmp_path)
  written = (tmp_path / 'config.json').read_bytes()
  config.model.d_model = 32
  config.seed = 7
  assert exit_status(config, str(tmp_path)) == 2
  error = capsys.readouterr().err
  assert 'config.model.d_model: 16 -> 32' in error
  assert 'config.seed: 0 -> 7' in error
  assert (tmp_path / 'config.json').read_bytes() == written
  assert not os.path.exists(tmp_path / 'config_history.jsonl')


def test_a_resume_with_a_changed_log_every_proceeds_and_is_recorded(
    data_dir, tmp_path, capsys):
  config = a_recorded_run(data_dir, tmp_path)
  written = (tmp_path / 'config.json').read_bytes()
  config.log_every = 5
  for _ in range(2):  # Recorded once: the second resume changes nothing.
    with workdir.claim(config, str(tmp_path)):
      pass
  assert 'config.log_every: 2 -> 5' in capsys.readouterr().out
  with open(tmp_path / 'config_history.jsonl') as f:
    [line] = [json.loads(line) for line in f]
  assert line['changes'] == {'log_every': [2, 5]}
  assert workdir.recorded_config(str(tmp_path))['log_every'] == 5
  assert (tmp_path / 'config.json').read_bytes() == written


def test_a_workdir_without_a_record_takes_the_new_config(data_dir, tmp_path):
  """A run that stopped before logging anything (say its dataset was
  missing) binds nothing."""
  config = tiny_config('lm_stdlib', data_dir)
  with workdir.claim(config, str(tmp_path)):
    pass
  config.model.d_model = 32
  with workdir.claim(config, str(tmp_path)):
    pass
  assert workdir.recorded_config(str(tmp_path))['model.d_model'] == 32


@pytest.mark.core
@pytest.mark.parametrize('schedule, allowed', [
    ('cosine', False), ('linear', False), ('rsqrt', True), ('constant', True)])
def test_more_steps_only_where_the_schedule_does_not_depend_on_them(
    schedule, allowed):
  old = {'num_train_steps': 100, 'schedule': schedule}
  new = {'num_train_steps': 200, 'schedule': schedule}
  if allowed:
    assert workdir.check_resume(old, new) == {'num_train_steps': (100, 200)}
  else:
    with pytest.raises(InputError, match=f'change the {schedule} schedule'):
      workdir.check_resume(old, new)


@pytest.mark.core
def test_the_layout_of_the_blocks_may_change_on_a_resume():
  """scan_layers, as remat, says how the run is laid out: its checkpoints
  convert (tests/train/program/test_sharding.py)."""
  old = {'model.scan_layers': False, 'model.remat': 'none'}
  new = {'model.scan_layers': True, 'model.remat': 'full'}
  assert workdir.check_resume(old, new) == {
      'model.scan_layers': (False, True), 'model.remat': ('none', 'full')}


def test_a_key_added_since_and_left_unset_is_no_change():
  """A workdir recorded before config.model.attention_options held its
  unset options resumes."""
  old = {'model.d_model': 32}
  new = old | {'model.attention_options.window': None}
  assert workdir.check_resume(old, new) == {}
  with pytest.raises(InputError, match=r"config.model.attention_options."
                     r"window: '\(absent\)' -> 32"):
    workdir.check_resume(old, new | {'model.attention_options.window': 32})


def test_a_key_added_since_at_its_default_is_no_change():
  """A workdir recorded before config.model.qk_norm and config.z_loss
  existed resumes with them at their defaults, and not with others."""
  old = {'model.d_model': 32}
  new = old | {'model.qk_norm': 'none', 'z_loss': 0.0}
  assert workdir.check_resume(old, new) == {}
  with pytest.raises(InputError, match=r"config.model.qk_norm: '\(absent\)' "
                     r"-> 'rmsnorm'"):
    workdir.check_resume(old, new | {'model.qk_norm': 'rmsnorm'})


def test_a_cut_history_line_is_named_not_a_traceback(data_dir, tmp_path):
  config = a_recorded_run(data_dir, tmp_path)
  (tmp_path / 'config_history.jsonl').write_text('{"changes": {"log_ev')
  with pytest.raises(InputError, match='config_history.jsonl cannot be read'):
    workdir.claim(config, str(tmp_path))
