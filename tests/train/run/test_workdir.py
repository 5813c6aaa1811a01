"""A workdir belongs to one run and one config: a second run is refused,
a killed run's lock is taken over, a resume may change only how the run is
observed, stopped or laid out."""

import asyncio
import errno
import json
import logging
import os
import socket
import threading
import time
import types

import gcsfs
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
  # Another run's lock, as another process would hold it: its lease bounds
  # that run's operations on the store, not those of the run claiming it.
  storage.lease(path, None)
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


@pytest.mark.parametrize('seconds', ['soon', '0'])
def test_a_store_timeout_that_is_not_seconds_is_refused_by_name(
    data_dir, object_store, tmp_path, monkeypatch, capsys, seconds):
  monkeypatch.setenv(storage.TIMEOUT_VARIABLE, seconds)
  path = f'{object_store}/{tmp_path.name}'
  assert exit_status(tiny_config('lm_stdlib', data_dir), path) == 2
  assert capsys.readouterr().err == (
      f"error: {storage.TIMEOUT_VARIABLE}='{seconds}' is not a number of "
      'seconds above 0 (the longest a run waits on an object store at a '
      'time).\n')
  assert not storage.path(f'{path}/lock').exists()


def test_on_an_object_store_a_watched_lock_is_deleted_only_as_watched(
    object_store, tmp_path, monkeypatch):
  """A killed run's lock, watched until it expired, is replaced by another
  run's before this run deletes it: the deletion holds only for the lock
  watched (its generation), so the other run's stays, and this run is
  refused naming it."""
  monkeypatch.setattr(workdir, 'LEASE_S', 0.4)
  lock = storage.path(f'{object_store}/{tmp_path.name}/lock')
  storage.write_whole(lock, json.dumps(
      {'host': 'node7', 'pid': 4242, 'since': '2026-01-01T00:00:00'}))
  watch = workdir.LeaseLock._watch

  def watched_then_taken(self, found):
    left = watch(self, found)
    storage.write_whole(lock, json.dumps(
        {'host': 'node8', 'pid': 4343, 'since': '2026-01-01T00:01:00'}))
    return left

  monkeypatch.setattr(workdir.LeaseLock, '_watch', watched_then_taken)
  with pytest.raises(InputError, match='in use by the run of pid 4343 on '
                     'node8'):
    workdir.LeaseLock(str(lock.parent))
  assert json.loads(lock.read_text())['pid'] == 4343


def test_on_an_object_store_of_two_runs_started_together_one_holds_it(
    object_store, tmp_path, monkeypatch):
  """Two claims of one lock, each past its look for a lock (none) before
  either creates one: the store's create-only-if-absent (checked by the
  emulator as GCS checks it) lets exactly one hold it, and the other is
  refused naming it."""
  monkeypatch.setattr(workdir, 'LEASE_S', 0.4)
  path = f'{object_store}/{tmp_path.name}'
  both_looked = threading.Barrier(2, timeout=30)
  write_if = storage.write_if

  def create_once_both_looked(file, text, generation):
    if generation == '0':  # Created only where there is no lock.
      both_looked.wait()
    return write_if(file, text, generation)

  monkeypatch.setattr(storage, 'write_if', create_once_both_looked)
  outcomes = []

  def claim():
    try:
      outcomes.append(workdir.LeaseLock(path))
    except InputError as error:
      outcomes.append(error)

  claims = [threading.Thread(target=claim) for _ in range(2)]
  for thread in claims:
    thread.start()
  for thread in claims:
    thread.join()
  holders = [lock for lock in outcomes if isinstance(lock, workdir.LeaseLock)]
  refusals = [str(error) for error in outcomes
              if isinstance(error, InputError)]
  for lock in holders:
    lock.release()
  assert len(holders) == 1 and len(refusals) == 1, outcomes
  assert f'in use by the run of pid {os.getpid()}' in refusals[0]


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


def test_a_config_described_before_a_variant_was_registered_is_the_same():
  """What a comparison's result.json records (its config's JSON) still
  names the run once a variant registered since adds its unset options."""
  old = json.dumps({'model': {'d_model': 32, 'attention_options': {}}})
  new = json.dumps({'model': {'d_model': 32, 'attention_options': {
      'moba': {'top_k': None}}}})
  assert workdir.same_config(old, new)
  assert not workdir.same_config(old, new.replace('null', '2'))
  assert not workdir.same_config(old, new.replace('32', '64'))


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


def files_of(path) -> dict[str, bytes]:
  return {str(file.relative_to(path)): file.read_bytes()
          for file in sorted(path.rglob('*')) if file.is_file()}


def test_a_run_without_its_config_json_is_refused_and_nothing_written(
    data_dir, tmp_path, capsys):
  """config.json lost (checkpoints, metrics and history present): another
  config would resume unchecked, so the start is refused by name."""
  config = a_recorded_run(data_dir, tmp_path)
  config.log_every = 5
  with workdir.claim(config, str(tmp_path)):  # A line of history.
    pass
  (tmp_path / 'checkpoints' / '16').mkdir(parents=True)
  (tmp_path / 'config.json').unlink()
  kept = files_of(tmp_path)
  config.learning_rate *= 2
  assert exit_status(config, str(tmp_path)) == 2
  error = capsys.readouterr().err
  assert error.startswith(
      f'error: --workdir={tmp_path} holds a run (checkpoints, '
      'metrics.jsonl, config_history.jsonl) but not its config.json')
  assert error.rstrip().endswith(
      f'restore {tmp_path}/config.json from a copy to resume it, or give '
      'this run another --workdir.')
  assert error.count('\n') == 1
  assert files_of(tmp_path) == kept


def test_a_run_killed_before_writing_config_json_binds_nothing(
    data_dir, tmp_path):
  """What a start leaves before its first step (the lock, an empty
  checkpoints/ and metrics.jsonl) is no record of a run."""
  (tmp_path / 'checkpoints').mkdir()
  (tmp_path / 'metrics.jsonl').write_text('')
  (tmp_path / 'lock').write_text('')
  with workdir.claim(tiny_config('lm_stdlib', data_dir), str(tmp_path)):
    pass
  assert workdir.recorded_config(str(tmp_path))['model.d_model'] == 16


def test_a_garbled_config_json_is_named_with_the_way_to_recover(
    data_dir, tmp_path):
  config = a_recorded_run(data_dir, tmp_path)
  (tmp_path / 'config.json').write_text('{"model": {"d_mod')
  with pytest.raises(InputError, match=(
      r'config.json cannot be read \(.*\); it records this workdir\'s '
      r'config: restore it from a copy, or use another workdir.')):
    workdir.claim(config, str(tmp_path))


def test_a_start_refused_after_its_claim_leaves_no_workdir(data_dir,
                                                           tmp_path):
  """A refusal once the workdir is claimed (here the dataset's vocabulary,
  checked once it is read) removes the workdir the run made."""
  config = tiny_config('lm_stdlib', data_dir)
  config.model.vocab_size = 100
  path = tmp_path / 'new'
  assert exit_status(config, str(path)) == 2
  assert not path.exists()


def test_a_refusal_keeps_a_workdir_the_run_did_not_make_or_recorded_in(
    data_dir, tmp_path):
  config = tiny_config('lm_stdlib', data_dir)
  with pytest.raises(InputError):
    with workdir.claim(config, str(tmp_path)):  # It exists already.
      raise InputError('refused')
  assert (tmp_path / 'config.json').exists()
  made = tmp_path / 'made'
  with pytest.raises(InputError):
    with workdir.claim(config, str(made)):
      (made / 'metrics.jsonl').write_text('{"step": 1, "loss": 1.0}\n')
      raise InputError('refused')
  assert (made / 'config.json').exists()


def test_on_an_object_store_a_renewal_written_unseen_keeps_the_lease(
    object_store, tmp_path, monkeypatch):
  """A renewal the store wrote but whose answer was lost (its library
  retried it and met its own write: 412) is known by the lock's token:
  the run keeps its lease, and releases it."""
  path = f'{object_store}/{tmp_path.name}'
  lock = workdir.LeaseLock(path)
  write_if = storage.write_if

  def written_unseen(file, text, generation):
    write_if(file, text, generation)
    return None

  try:
    monkeypatch.setattr(storage, 'write_if', written_unseen)
    lock.renew()
    monkeypatch.setattr(storage, 'write_if', write_if)
    lock.renew()
  finally:
    lock.release()
  assert not storage.path(f'{path}/lock').exists()


def test_on_an_object_store_failing_renewals_are_said_once_then_as_they_end(
    object_store, tmp_path, monkeypatch, capsys):
  """Renewals the store fails (a partition) are said once, not at each
  renewal; once one is confirmed again, that is said; and once none has
  been for the lease, the run's next check stops it (LeaseLost, one
  line), the lock's own thread having said nothing more."""
  monkeypatch.setattr(workdir, 'LEASE_S', 2.0)
  path = f'{object_store}/{tmp_path.name}'
  lock = workdir.LeaseLock(path)
  write_if = storage.write_if

  def unavailable(file, text, generation):
    raise OSError(errno.EIO, '503 Service Unavailable')

  try:
    monkeypatch.setattr(storage, 'write_if', unavailable)
    for _ in range(3):
      lock.renew()
    monkeypatch.setattr(storage, 'write_if', write_if)
    lock.renew()
    monkeypatch.setattr(storage, 'write_if', unavailable)
    with pytest.raises(workdir.LeaseLost) as lost:
      # The run's checks before its writes, for up to two leases.
      for _ in range(int(2 * workdir.LEASE_S / 0.05)):
        lock.check()
        time.sleep(0.05)
  finally:
    lock.release()
  failing = (f'warning: could not renew {path}/lock (503 Service '
             'Unavailable); trying again every 0.5 s.')
  said = capsys.readouterr().out.splitlines()
  assert [line.startswith(failing) for line in said] == [True, False, True]
  assert said[1].startswith(f'{path}/lock renewed again, ')
  assert str(lost.value) == (
      f'{path}/lock could not be renewed for 2 s (this run stalled, or was '
      'cut off from the store), so another run may own the workdir now: '
      'this run stopped without writing the workdir again; run the same '
      'command to resume.')


def test_an_unreachable_store_is_said_in_one_line(data_dir, monkeypatch,
                                                 capsys, caplog):
  """A gs:// workdir whose store nothing answers for (a closed port): one
  line, exit status 2, and none of gcsfs's logs of its failed retries
  (each with its traceback)."""
  with socket.socket() as probe:  # A port nothing listens on, once closed.
    probe.bind(('127.0.0.1', 0))
    port = probe.getsockname()[1]
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', f'http://127.0.0.1:{port}')
  # gcsfs's retries at once, not over half a minute.
  monkeypatch.setattr(gcsfs.retry, 'asyncio', types.SimpleNamespace(
      sleep=lambda seconds: asyncio.sleep(0)))
  config = tiny_config('lm_stdlib', data_dir)
  with pytest.raises(SystemExit) as exit_info:
    cli.outcome(lambda: workdir.claim(config, 'gs://a-bucket/run'))
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == (
      'error: --workdir=gs://a-bucket/run cannot be written: Connect call '
      f"failed ('127.0.0.1', {port}).\n")
  assert not [record for record in caplog.records
              if record.name.startswith('gcsfs')
              and record.levelno >= logging.WARNING]


def test_on_an_object_store_every_host_stops_once_process_0_lost_the_lease(
    monkeypatch):
  """The check before a write on a host other than process 0 (no lock of
  its own) stops it too, so that no host waits in a collective the others
  left."""
  check = workdir._leased(None)
  check(confirm=True)
  monkeypatch.setattr(workdir.hosts, 'minimum_over_hosts', lambda ok: 0.0)
  with pytest.raises(workdir.LeaseLost, match='process 0 found'):
    check(confirm=True)
