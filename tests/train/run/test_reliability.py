"""A run killed anywhere resumes bit for bit; a stop signal saves first;
non-finite steps, unwritable workdirs, full disks and corrupted dataset
files are reported, never silently lost.

The interrupted runs are real `train.train` processes, killed on cue by
tests/helpers/interrupted_train.py; each is compared with one uninterrupted
run of the same config.
"""

import errno
import glob
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
import types

import fsspec
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import algorithmic, lm_stdlib
from tests.helpers import REPO
from tests.helpers import config_overrides
from tests.helpers import interrupted_train
from tests.helpers import object_store as emulator
from tests.helpers import tolerance
from tests.helpers.checkpoint_damage import flip_a_bit_orbax_reads_silently
from tests.helpers.tiny_runs import tiny_config
from train import train
from train.base import storage
from train.base.errors import InputError
from train.base.train_config import TrainConfig
from train.config import validation as config_validation
from train.data import datasets, pipeline
from train.run import checkpointing
from train.run import workdir as workdir_lib
from train.run.program import Program
from train.run import trainer
from train.run.trainer import train_and_evaluate

LAST_STEP = 12
# Depend on the clock, not on the run.
TIMING_KEYS = {'time', 'tokens_per_s', 'steps_per_s', 'mfu'}


def overrides(data_dir: str, **extra) -> dict:
  """A tiny lm_stdlib run (the second search's winner, whose attention
  has no windows of its own) with dropout and local attention (its options
  set by their dotted keys, on the command lines too), its window growing
  from 2 to 4 at step 2 and to its own 8 at step 8: 12 steps, every
  step logged, a checkpoint every 3 steps and an evaluation every 6."""
  values = {
      'data_dir': data_dir, 'seq_len': 32, 'batch_size': 8,
      'num_train_steps': LAST_STEP, 'warmup_steps': 2, 'log_every': 1,
      'eval_every': 6, 'checkpoint_every': 3, 'num_eval_steps': 1,
      'sample_length': 0, 'model.d_model': 16, 'model.num_heads': 2,
      'model.num_layers': 1, 'model.mlp_dim': 32, 'model.max_len': 33,
      'model.dropout_rate': 0.1, 'model.attention': 'local',
      'model.attention_options.window': 8,
      'model.attention_options.kernel': 'xla',
      'window_schedule': ((2, 2), (8, 4))}
  return values | extra


def config_of(values: dict):
  return config_overrides.apply(lm_stdlib.get_config('round2'), values)


def interrupted_command(workdir, values: dict, interrupt: str | None,
                        lease_s: float = interrupted_train.LEASE_S
                        ) -> list[str]:
  """The command line of train.train interrupted on cue (see
  tests/helpers/interrupted_train.py) unless `interrupt` is None, its
  lease on an object store `lease_s` long."""
  return [sys.executable, 'tests/helpers/interrupted_train.py',
          f'--interrupt={interrupt or "none"}', f'--lease_s={lease_s}',
          '--config=configs/lm_stdlib.py:round2', f'--workdir={workdir}',
          *[f'--config.{key}={value}' for key, value in values.items()]]


def run_interrupted(workdir, values: dict, interrupt: str | None):
  """train.train in a subprocess (bounded in time), interrupted on cue
  unless `interrupt` is None."""
  return subprocess.run(interrupted_command(workdir, values, interrupt),
                        cwd=REPO, capture_output=True, text=True,
                        timeout=300)


def checkpoints(workdir) -> list[str]:
  path = storage.path(workdir) / 'checkpoints'
  return sorted(p.name for p in path.iterdir() if p.name[0].isdigit())


def metric_lines(workdir) -> list[dict]:
  text = (storage.path(workdir) / 'metrics.jsonl').read_text()
  return [{key: value for key, value in json.loads(line).items()
           if key not in TIMING_KEYS} for line in text.splitlines()]


def saved_state(workdir, step: int):
  """Parameters and optimizer state of a checkpoint, as saved."""
  manager = ocp.CheckpointManager(
      os.path.join(workdir, 'checkpoints'),
      options=ocp.CheckpointManagerOptions(read_only=True),
      item_handlers={'state': ocp.StandardCheckpointHandler()})
  state = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore()))['state']
  manager.close()
  return {'params': state['params'], 'opt_state': state['opt_state'],
          'step': state['step']}


@pytest.fixture(scope='module')
def uninterrupted(data_dir, tmp_path_factory):
  """The workdir of the run nothing interrupts."""
  workdir = str(tmp_path_factory.mktemp('uninterrupted'))
  compiled = []
  train_and_evaluate(config_of(overrides(data_dir)), workdir,
                     on_compiled=compiled.append)
  assert len(compiled) == 3  # A program for each window, compiled once.
  return workdir


def assert_same_run(workdir, uninterrupted):
  """Final state bitwise equal; every logged step (first tries of redone
  steps included) has the uninterrupted run's metrics."""
  tolerance.assert_bitwise_equal(saved_state(workdir, LAST_STEP),
                                 saved_state(uninterrupted, LAST_STEP))
  want = {line['step']: line for line in metric_lines(uninterrupted)}
  lines = metric_lines(workdir)
  assert {line['step'] for line in lines} == set(want)
  for line in lines:
    assert line == want[line['step']]


def test_runs_killed_at_three_points_resume_bit_for_bit(
    data_dir, tmp_path, uninterrupted):
  rng = random.Random()
  first_kill, last_kill = rng.choice([4, 5]), rng.choice([10, 11])
  workdir = str(tmp_path / 'killed')
  values = overrides(data_dir)

  # SIGKILL mid-run: the checkpoint of step 3 is the latest.
  killed = run_interrupted(workdir, values, f'kill:{first_kill}')
  assert killed.returncode == -9, (first_kill, killed.stderr[-2000:])
  assert checkpoints(workdir) == ['3']

  # SIGKILL during the save of step 6: written, never committed.
  killed = run_interrupted(workdir, values, 'save:6')
  assert killed.returncode == -9, killed.stderr[-2000:]
  assert checkpoints(workdir) == ['3', '6.orbax-checkpoint-tmp']

  # The half-written checkpoint is reported and skipped.
  killed = run_interrupted(workdir, values, f'kill:{last_kill}')
  assert killed.returncode == -9, (last_kill, killed.stderr[-2000:])
  assert 'ignoring the incomplete checkpoint' in killed.stdout
  assert 'Resumed from the checkpoint at step 3.' in killed.stdout
  assert checkpoints(workdir) == ['3', '6', '9']

  finished = run_interrupted(workdir, values, None)
  assert finished.returncode == 0, finished.stderr[-2000:]
  assert 'Resumed from the checkpoint at step 9.' in finished.stdout
  assert ('Attention kernels: decoder layer 0 local: xla (as set; float32, '
          "causal, packed rows, ALiBi's bias, window 8)" in finished.stdout)
  assert ('Long windows: 2 before step 2, 4 before step 8, then 8; a '
          'program compiled for each.' in finished.stdout)
  assert_same_run(workdir, uninterrupted)


def test_a_run_on_an_object_store_killed_and_damaged_resumes_bit_for_bit(
    data_dir, object_store, tmp_path, uninterrupted):
  """A workdir on gs:// (a local emulator): killed once the checkpoint of
  step 6 is written, that checkpoint then damaged by a flipped bit. The
  next run takes over the killed run's lock, moves checkpoint 6 aside,
  resumes from step 3's and ends as the uninterrupted run on disk did."""
  workdir = f'{object_store}/{tmp_path.name}'
  values = overrides(data_dir)
  killed = run_interrupted(workdir, values, 'kill:7')
  assert killed.returncode == -9, killed.stderr[-2000:]
  assert checkpoints(workdir) == ['3', '6']
  flip_a_bit_orbax_reads_silently(
      workdir, 6, Program.from_config(config_of(values)).abstract_state)

  finished = run_interrupted(workdir, values, None)
  assert finished.returncode == 0, finished.stderr[-2000:]
  assert f'taking over {workdir}/lock from the run of pid' in finished.stdout
  # The emulator takes no credentials: tensorstore's error that it found
  # none is not said where the store answers.
  for run in (killed, finished):
    assert storage.NO_CREDENTIALS not in run.stderr
  [damaged] = [line for line in finished.stdout.splitlines()
               if 'damaged' in line]
  assert damaged.startswith('warning: the checkpoint of step 6 is damaged: '
                            'the array')
  assert damaged.endswith(f'moved to {workdir}/corrupt_checkpoints/6.')
  # Step 6 saved again; the last three kept.
  assert sorted(map(int, checkpoints(workdir))) == [6, 9, 12]
  assert 'Resumed from the checkpoint at step 3.' in finished.stdout
  assert not storage.path(f'{workdir}/lock').exists()
  assert_same_run(workdir, uninterrupted)


def wait_until_stopped(process: subprocess.Popen, errors) -> None:
  """Returns once `process` is stopped (SIGSTOP); fails, showing the
  file of its `errors`, if it ends or takes 300 s."""
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    pid, status = os.waitpid(process.pid, os.WUNTRACED | os.WNOHANG)
    if pid and os.WIFSTOPPED(status):
      return
    assert not pid, errors.read_text()[-2000:]
    time.sleep(0.1)
  process.kill()
  pytest.fail('the run did not reach its stall in 300 s')


def unchanging_objects(workdir) -> dict[str, str]:
  """{name: generation} of the objects of a workdir on a store but its
  lock and TensorBoard's events (tensorboardX flushes its own file as the
  process exits)."""
  store, root = fsspec.core.url_to_fs(workdir)
  return {name: info['generation']
          for name, info in store.find(root, detail=True).items()
          if not name.endswith('/lock') and '/tensorboard/' not in name}


def wait_until_said(process: subprocess.Popen, output, line: str,
                    errors) -> None:
  """Returns once `process` has said `line` in the file of its `output`;
  fails, showing the file of its `errors`, if it ends first or takes
  300 s."""
  deadline = time.monotonic() + 300
  while line not in output.read_text().splitlines():
    assert process.poll() is None, errors.read_text()[-2000:]
    if time.monotonic() > deadline:
      process.kill()
      pytest.fail(f'the run did not say {line!r} in 300 s')
    time.sleep(0.1)


def test_a_run_cut_off_past_its_lease_writes_nothing_once_it_heals(
    data_dir, object_store, tmp_path, monkeypatch):
  """The race of a partition that heals: a run on gs:// whose upload of
  metrics.jsonl, right after its lease was confirmed for the checkpoint
  of step 6, is held (interrupted_train's `partition`) past its lease,
  and taken over meanwhile by a newcomer. Once the partition heals,
  neither that upload (the line of step 6) nor the checkpoint of step 6
  has landed, nor does any other object of the workdir change; the run
  says in one line that it stopped without writing again, and exits with
  status 0, as for a stop. The newcomer keeps the lock."""
  monkeypatch.setattr(workdir_lib, 'LEASE_S', interrupted_train.LEASE_S)
  workdir = f'{object_store}/{tmp_path.name}'
  output, errors = tmp_path / 'stdout', tmp_path / 'stderr'
  with open(output, 'w') as out, open(errors, 'w') as err:
    cut_off = subprocess.Popen(
        interrupted_command(workdir, overrides(data_dir), 'partition:6'),
        cwd=REPO, stdout=out, stderr=err, text=True)
  wait_until_said(cut_off, output, 'partitioned', errors)
  newcomer = workdir_lib.LeaseLock(workdir)
  try:
    before = unchanging_objects(workdir)
    if cut_off.poll() is None:
      cut_off.send_signal(signal.SIGUSR1)  # Healed.
    assert cut_off.wait(timeout=120) == 0, errors.read_text()[-2000:]
    assert unchanging_objects(workdir) == before
    holder = json.loads(storage.path(f'{workdir}/lock').read_text())
  finally:
    newcomer.release()
  assert holder['pid'] == os.getpid()
  assert checkpoints(workdir) == ['3']
  assert max(line['step'] for line in metric_lines(workdir)) < 6
  [said] = [line for line in output.read_text().splitlines()
            if 'stopped without writing the workdir again' in line]
  assert said.startswith(f'{workdir}/lock ')
  assert 'Traceback' not in errors.read_text()


# The store's time bound in the outage test, in seconds: more than a save
# takes on shared cores.
STORE_TIMEOUT_S = 10
# What a run may take past it: two steps, and the writes the failed save
# leaves (metrics, TensorBoard's events, the lock's release), which fail
# at once once one operation on the store has waited past the bound.
MARGIN_S = 10
# The outage test's lease, longer than the bound: its run meets the bound
# first (a lease that lapses first stops the run as when it is taken over).
LEASE_OVER_STORE_TIMEOUT_S = 3 * STORE_TIMEOUT_S


def test_a_store_that_stops_answering_stops_the_run_at_its_next_save(
    data_dir, tmp_path):
  """A run on gs:// whose store stops answering (an emulator of its own,
  killed while the run is stalled once the checkpoint of step 6 is
  written) fails its next save within the store's time bound
  (ATTNLAB_STORE_TIMEOUT_S, below its lease) and a margin: exit status 1,
  one line naming the step and the last complete checkpoint."""
  environ = dict(os.environ)
  environ[storage.TIMEOUT_VARIABLE] = str(STORE_TIMEOUT_S)
  server = emulator.emulate(environ)
  workdir = f'gs://{emulator.BUCKET}/{tmp_path.name}'
  errors = tmp_path / 'stderr'
  try:
    with open(errors, 'w') as err:
      cut_off = subprocess.Popen(
          interrupted_command(workdir, overrides(data_dir), 'stall:7',
                              lease_s=LEASE_OVER_STORE_TIMEOUT_S),
          cwd=REPO, env=environ, stdout=subprocess.DEVNULL, stderr=err,
          text=True)
    wait_until_stopped(cut_off, errors)
  finally:
    server.kill()
    server.wait()
  cut_off.send_signal(signal.SIGCONT)
  try:
    assert cut_off.wait(timeout=STORE_TIMEOUT_S + MARGIN_S) == 1, (
        errors.read_text()[-2000:])
  finally:
    cut_off.kill()
  said = [line for line in errors.read_text().splitlines()
          if line.startswith('error:')]
  assert said == [
      f'error: could not write the checkpoint of step 9 in {workdir}/'
      f'checkpoints: gs://{emulator.BUCKET} did not answer within '
      f'{STORE_TIMEOUT_S} s ({storage.TIMEOUT_VARIABLE}). The last complete '
      'checkpoint is step 6; run the same command to resume from it.']


def test_an_evaluation_reads_the_window_its_model_trained_with_last(
    data_dir, uninterrupted):
  """The evaluation at step 6 of the growing window scores the parameters
  of step 6 at window 4, as steps 3-8 train, not at the model's own 8."""
  program = Program.from_config(config_of(overrides(data_dir)))
  dataset = datasets.load(program.config, uninterrupted)
  params = saved_state(uninterrupted, 6)['params']
  [logged] = [line for line in metric_lines(uninterrupted)
              if line['step'] == 6 and 'eval_loss' in line]
  stages = {4: program.for_window(4), 8: program}
  with program.scope():
    at = {window: trainer.evaluation(
        program.config, dataset, stage, uninterrupted, 'packed')(params)[
            'eval_loss'] for window, stage in stages.items()}
  assert logged['eval_loss'] == pytest.approx(at[4], rel=1e-6)
  assert logged['eval_loss'] != pytest.approx(at[8], rel=1e-6)


def test_a_run_of_several_steps_a_call_resumes_at_another_bit_for_bit(
    data_dir, tmp_path, uninterrupted):
  """config.steps_per_call: killed inside a call of 4 steps (5-8, once the
  checkpoint of step 4 is written; steps 1-4 one at a time, as the window
  changes at step 2), resumed 3 steps a call (5-9 one at a time, as the
  window changes at step 8, then 10-12): the uninterrupted run's final
  state, which took one step a call. Logging, evaluation and checkpoints
  change no state, so their intervals follow the calls."""
  workdir = str(tmp_path / 'calls')
  values = overrides(data_dir, steps_per_call=4, log_every=4, eval_every=0,
                     checkpoint_every=4)
  killed = run_interrupted(workdir, values, 'kill:6')
  assert killed.returncode == -9, killed.stderr[-2000:]
  assert ('4 steps a call; steps 1-4 one at a time (a program of their '
          'own).' in killed.stdout)
  assert checkpoints(workdir) == ['4']
  values |= dict(steps_per_call=3, log_every=6, checkpoint_every=6)
  finished = run_interrupted(workdir, values, None)
  assert finished.returncode == 0, finished.stderr[-2000:]
  assert ('3 steps a call; steps 5-9 one at a time (a program of their own).'
          in finished.stdout)
  tolerance.assert_bitwise_equal(saved_state(workdir, LAST_STEP),
                                 saved_state(uninterrupted, LAST_STEP))


def test_sigterm_saves_the_step_reached_and_exits_0(
    data_dir, tmp_path, uninterrupted):
  workdir = str(tmp_path / 'preempted')
  values = overrides(data_dir)
  stopped = run_interrupted(workdir, values, 'term:5')
  assert stopped.returncode == 0, stopped.stderr[-2000:]
  assert 'SIGTERM: saved the checkpoint of step 5' in stopped.stdout
  assert checkpoints(workdir) == ['3', '5']

  train_and_evaluate(config_of(values), workdir)
  assert_same_run(workdir, uninterrupted)


def test_a_non_finite_step_stops_the_run_keeping_the_last_checkpoint(
    data_dir, tmp_path, capsys):
  workdir = str(tmp_path / 'stop')
  config = config_of(overrides(data_dir, num_train_steps=6,
                               window_schedule=(), debug_poison_step=5))
  with pytest.raises(SystemExit) as exit_:
    train.run(config, workdir)
  assert exit_.value.code == 1
  message = capsys.readouterr().err
  assert "step 5: the loss is nan (config.nan_policy='stop')" in message
  assert (f'the last checkpoint, step 3 in {workdir}/checkpoints, is from '
          'before it' in message)
  assert checkpoints(workdir) == ['3']
  assert [line['step'] for line in metric_lines(workdir)] == [1, 2, 3, 4]


def test_a_skipped_step_leaves_the_state_as_it_was(data_dir, tmp_path):
  workdir = str(tmp_path / 'skip')
  config = config_of(overrides(
      data_dir, num_train_steps=6, window_schedule=(), checkpoint_every=1,
      keep_checkpoints=6, nan_policy='skip', debug_poison_step=5))
  final = train_and_evaluate(config, workdir)
  assert np.isfinite(final['eval_loss'])
  lines = metric_lines(workdir)
  assert [line['skipped_steps'] for line in lines] == [0, 0, 0, 0, 1, 0]
  before, skipped = saved_state(workdir, 4), saved_state(workdir, 5)
  assert int(skipped['step']) == 5
  del before['step'], skipped['step']
  tolerance.assert_bitwise_equal(skipped, before)


def test_more_skipped_steps_in_a_row_than_allowed_stop_the_run(
    data_dir, tmp_path, capsys):
  config = config_of(overrides(
      data_dir, num_train_steps=3, window_schedule=(), nan_policy='skip',
      max_skipped_steps=0,
      debug_poison_step=2))
  with pytest.raises(SystemExit) as exit_:
    train.run(config, str(tmp_path))
  assert exit_.value.code == 1
  assert ('steps 2-2: 1 updates in a row had a non-finite loss or gradient '
          'and were skipped, more than config.max_skipped_steps=0'
          in capsys.readouterr().err)


@pytest.mark.core
def test_an_unwritable_workdir_is_reported_before_training(
    data_dir, tmp_path, capsys):
  blocker = tmp_path / 'a_file'
  blocker.write_text('')
  with pytest.raises(SystemExit) as exit_:
    train.run(config_of(overrides(data_dir)), str(blocker / 'workdir'))
  assert exit_.value.code == 2
  assert (f'--workdir={blocker}/workdir cannot be written: Not a directory'
          in capsys.readouterr().err)


def test_a_disk_without_room_for_a_checkpoint_is_reported_before_training(
    data_dir, tmp_path, monkeypatch):
  monkeypatch.setattr(checkpointing.shutil, 'disk_usage',
                      lambda path: types.SimpleNamespace(free=1000))
  with pytest.raises(InputError, match='not enough disk space for a '
                     r'checkpoint in .*: one takes .* MiB, 0.0 MiB are free'):
    train_and_evaluate(config_of(overrides(data_dir)), str(tmp_path))


def test_a_failed_save_stops_the_run_naming_the_last_complete_checkpoint(
    data_dir, tmp_path, monkeypatch, capsys):
  write = ocp.JsonCheckpointHandler._save_fn

  async def disk_full_at_step_6(self, item, directory):
    if '/6.' in str(directory):
      raise OSError(errno.ENOSPC, 'No space left on device')
    return await write(self, item, directory)

  monkeypatch.setattr(ocp.JsonCheckpointHandler, '_save_fn',
                      disk_full_at_step_6)
  workdir = str(tmp_path / 'full')
  with pytest.raises(SystemExit) as exit_:
    train.run(config_of(overrides(data_dir)), workdir)
  assert exit_.value.code == 1
  assert ('could not write the checkpoint of step 6 in '
          f'{workdir}/checkpoints: [Errno 28] No space left on device. The '
          'last complete checkpoint is step 3' in capsys.readouterr().err)
  assert '3' in checkpoints(workdir) and '6' not in checkpoints(workdir)


@pytest.fixture
def algorithmic_config(tmp_path):
  config = algorithmic.get_config('task=addition')
  config.data_dir = str(tmp_path / 'data')
  config.dataset_options.update(num_train=200, num_eval=20, max_length=8,
                                long_max_length=12)
  return TrainConfig.from_config(config)


def train_file(config) -> str:
  datasets.load(config, config.data_dir)  # Builds it.
  [path] = glob.glob(f'{config.data_dir}/**/*-train.array_record*',
                     recursive=True)
  return path


def test_a_truncated_dataset_file_is_named_with_how_to_rebuild(
    algorithmic_config):
  path = train_file(algorithmic_config)
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)
  with pytest.raises(InputError) as error:
    datasets.load(algorithmic_config, algorithmic_config.data_dir)
  assert f'dataset file {path} cannot be read' in str(error.value)
  assert (f'Delete {os.path.dirname(path)} and run again: it is rebuilt on '
          'first use.' in str(error.value))


@pytest.mark.parametrize('damage', ['garbage', 'deleted'])
def test_damaged_dataset_metadata_is_named_with_how_to_rebuild(
    algorithmic_config, damage):
  path = os.path.join(os.path.dirname(train_file(algorithmic_config)),
                      'dataset_info.json')
  if damage == 'garbage':
    pathlib.Path(path).write_text('{not json')
  else:
    os.remove(path)
  with pytest.raises(InputError) as error:
    datasets.load(algorithmic_config, algorithmic_config.data_dir)
  assert str(error.value).startswith(
      f'{path} is {"damaged" if damage == "garbage" else "missing"}')
  assert 'run again' in str(error.value)


def test_a_corrupted_dataset_file_is_named_when_read(algorithmic_config):
  path = train_file(algorithmic_config)
  data = bytearray(pathlib.Path(path).read_bytes())
  data[100:4000] = bytes(b ^ 0xFF for b in data[100:4000])
  pathlib.Path(path).write_bytes(bytes(data))
  dataset = datasets.load(algorithmic_config, algorithmic_config.data_dir)
  batches = pipeline.train_iterator(dataset, seq_len=16, batch_size=8,
                                    seed=0)
  with pytest.raises(InputError, match=f'dataset file {path} is corrupted: '
                     'reading example .* failed .*Riegeli.* Delete '):
    for _ in range(30):  # Every example is read within 25 batches.
      next(batches)
  batches.close()


def test_a_step_that_cannot_fit_stops_before_it_runs(data_dir, tmp_path,
                                                     capsys, monkeypatch):
  """Dense attention over 2048 tokens, on devices said to hold 16 MiB."""
  monkeypatch.setattr(config_validation, 'device_bytes', lambda: 2**24)
  config = tiny_config('lm_stdlib', data_dir)
  config.seq_len = 2048
  config.model.update(max_len=2049, attention='dense')
  with pytest.raises(SystemExit) as exit_:
    train.run(config, str(tmp_path))
  assert exit_.value.code == 2
  error = capsys.readouterr().err
  assert 'a train step needs' in error
  assert 'on each device, which holds 16.0 MiB' in error
  assert 'config.batch_size=8 or config.seq_len=2048' in error
  assert not os.path.exists(tmp_path / 'checkpoints' / '2')
