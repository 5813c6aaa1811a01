"""A damaged checkpoint is found, reported in one line, moved aside and
never deleted, and the run resumes from the newest one that verifies."""

import asyncio
import glob
import json
import os
import shutil
import types

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.import_checkpoint import write_start
from tests.helpers.checkpoint_damage import flip_a_bit_orbax_reads_silently
from tests.helpers.tiny_runs import tiny_config
from train.base import storage
from train.base.errors import InputError, TrainingError
from train.data import datasets
from train.run import checkpointing, checksums, metrics, trained_run
from train.run import workdir as workdir_lib
from train.run.program import Program
from train.run import trainer
from train.run.trainer import train_and_evaluate


@pytest.fixture(scope='module')
def trained(data_dir, tmp_path_factory):
  """(config, workdir) of a tiny LM trained 4 steps: checkpoints 2 and 4."""
  config = tiny_config('lm_stdlib', data_dir)
  config.update(num_train_steps=4, schedule='constant')
  workdir = str(tmp_path_factory.mktemp('trained'))
  train_and_evaluate(config, workdir)
  return config, workdir


@pytest.fixture
def run(trained, tmp_path):
  """(config, a copy of the trained workdir, its checkpoints' shapes)."""
  config, workdir = trained
  copy = str(tmp_path / 'run')
  shutil.copytree(workdir, copy)
  program = Program.from_config(config)
  return config, copy, program.abstract_state


def truncate_the_array_files(step_dir):
  """Cut as a full disk cuts them (orbax reads the start of each file)."""
  for path in glob.glob(f'{step_dir}/state/**/d/*', recursive=True):
    os.truncate(path, os.path.getsize(path) // 20)


DAMAGE = {
    'truncated_array_files': truncate_the_array_files,
    'deleted_state_metadata': lambda step_dir: os.remove(
        f'{step_dir}/state/_METADATA'),
    'deleted_manifest': lambda step_dir: os.remove(
        f'{step_dir}/state/manifest.ocdbt'),
    'deleted_data_metadata': lambda step_dir: os.remove(
        f'{step_dir}/data/metadata'),
    # What an unmounted volume or a vanished directory looks like.
    'state_a_dangling_link': lambda step_dir: (
        shutil.rmtree(f'{step_dir}/state'),
        os.symlink('/nonexistent/state', f'{step_dir}/state')),
    # Without the recorded sizes (a run killed right after the commit),
    # orbax's own error finds it.
    'deleted_metadata_and_sizes': lambda step_dir: (
        os.remove(f'{step_dir}/state/_METADATA'),
        os.remove(f'{step_dir}/{checkpointing.FILE_SIZES}')),
}


def test_a_save_interrupted_as_it_starts_leaves_nothing_to_wait_for(
    run, capsys):
  """A second Ctrl-C while a save starts (here as the data iterator's
  state is read) leaves no save in flight: closing waits for none and
  says nothing of that step, which was never written."""
  _, workdir, abstract_state = run
  checkpointer = checkpointing.Checkpointer(workdir, keep=3)
  _, state = checkpointer.restore_latest(abstract_state)

  class InterruptedIterator:
    def get_state(self):
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    checkpointer.save(5, state, InterruptedIterator())
  checkpointer.close()
  assert capsys.readouterr().out == ''
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == [
      '2', '4', checkpointing.LEDGER]


def test_on_an_object_store_a_save_is_committed_only_within_the_lease(
    object_store, tmp_path):
  """orbax's commit of a checkpoint there (its commit file, written last)
  is made only while the workdir's lease holds: a save in flight whose
  lease lapsed first stays uncommitted, as one cut short does."""
  workdir = f'{object_store}/{tmp_path.name}'

  def lapsed() -> float:
    raise workdir_lib.LeaseLost('lapsed')

  def commit(step: int, seconds_left) -> bool:
    """Whether orbax's commit of `step` under the lease wrote its file."""
    step_dir = storage.path(f'{workdir}/checkpoints/{step}')
    storage.lease(workdir, seconds_left)
    try:
      asyncio.run(checkpointing._CommittedWithinTheLease.from_final(
          step_dir).finalize())
    finally:
      storage.lease(workdir, None)
    return (step_dir / checkpointing.COMMITTED).exists()

  with pytest.raises(asyncio.CancelledError):  # orbax's save ends quietly.
    commit(5, lapsed)
  assert not storage.path(
      f'{workdir}/checkpoints/5/{checkpointing.COMMITTED}').exists()
  assert commit(6, lambda: 60.0)


@pytest.mark.parametrize('damage', DAMAGE)
def test_a_damaged_checkpoint_falls_back_to_the_one_before(run, damage,
                                                           capsys):
  _, workdir, abstract_state = run
  DAMAGE[damage](os.path.join(workdir, 'checkpoints', '4'))
  checkpointer = checkpointing.Checkpointer(workdir, keep=3)
  step, _ = checkpointer.restore_latest(abstract_state)
  checkpointer.close()
  assert step == 2
  [warning] = capsys.readouterr().out.splitlines()
  assert warning.startswith('warning: the checkpoint of step 4 is damaged')
  assert os.path.exists(os.path.join(workdir, 'corrupt_checkpoints', '4'))


def delete_checksums_and_sizes(workdir: str, step: int) -> None:
  """A double fault, or a partial copy: the checkpoint's own checksums and
  its file sizes gone."""
  step_dir = os.path.join(workdir, 'checkpoints', str(step))
  shutil.rmtree(os.path.join(step_dir, 'checksums'))
  os.remove(os.path.join(step_dir, checkpointing.FILE_SIZES))


def restore_latest(workdir: str, abstract_state) -> tuple[int, list]:
  checkpointer = checkpointing.Checkpointer(workdir, keep=3)
  step, state = checkpointer.restore_latest(abstract_state)
  checkpointer.close()
  return step, [np.asarray(x) for x in jax.tree.leaves(state)]


def test_a_checkpoint_that_lost_its_checksums_is_verified_by_the_ledger(
    run, capsys):
  _, workdir, abstract_state = run
  delete_checksums_and_sizes(workdir, 4)
  step, _ = restore_latest(workdir, abstract_state)
  assert step == 4
  assert capsys.readouterr().out.splitlines() == [
      'warning: the checkpoint of step 4 has no checksums of its own; '
      'verified against the ledger.']


@pytest.mark.parametrize('deleted', ['', 'ledger', 'ledger and metadata'])
def test_deleting_the_checksums_of_a_damaged_checkpoint_does_not_restore_it(
    run, deleted, capsys):
  _, workdir, abstract_state = run
  flip_a_bit_orbax_reads_silently(workdir, 4, abstract_state)
  delete_checksums_and_sizes(workdir, 4)
  if deleted:
    os.remove(os.path.join(workdir, 'checkpoints', checkpointing.LEDGER))
  if 'metadata' in deleted:  # orbax's record of the items written.
    os.remove(os.path.join(workdir, 'checkpoints', '4',
                           '_CHECKPOINT_METADATA'))
  step, _ = restore_latest(workdir, abstract_state)
  assert step == 2
  [warning] = capsys.readouterr().out.splitlines()
  assert warning.startswith('warning: the checkpoint of step 4 is damaged: '
                            + ('its checksums are missing' if deleted
                               else 'the array'))


def test_a_garbled_ledger_entry_verifies_nothing(run, capsys):
  _, workdir, abstract_state = run
  delete_checksums_and_sizes(workdir, 4)
  ledger = os.path.join(workdir, 'checkpoints', checkpointing.LEDGER)
  with open(ledger, 'w') as f:
    f.write('{"4": [1, 2]}')
  step, _ = restore_latest(workdir, abstract_state)
  assert step == 2
  [warning] = capsys.readouterr().out.splitlines()
  assert warning.startswith('warning: the checkpoint of step 4 is damaged: '
                            'its checksums are missing')


def test_a_checkpoint_of_an_older_attnlab_restores_unverified_with_a_notice(
    run, capsys):
  """Written as attnlab wrote them before checksums: the state and the data
  iterator's position, nothing else."""
  _, workdir, abstract_state = run
  directory = os.path.join(workdir, 'checkpoints')
  handlers = {'state': ocp.StandardCheckpointHandler(),
              'data': ocp.JsonCheckpointHandler()}
  reader = ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(read_only=True),
      item_handlers=handlers)
  saved = reader.restore(4, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state),
      data=ocp.args.JsonRestore()))
  reader.close()
  shutil.rmtree(directory)
  writer = ocp.CheckpointManager(directory, item_handlers=handlers)
  writer.save(4, args=ocp.args.Composite(
      state=ocp.args.StandardSave(saved['state']),
      data=ocp.args.JsonSave(saved['data'])))
  writer.wait_until_finished()
  writer.close()
  step, arrays = restore_latest(workdir, abstract_state)
  assert step == 4
  chex.assert_trees_all_equal(arrays, jax.tree.leaves(saved['state']))
  assert capsys.readouterr().out.splitlines() == [
      'warning: the checkpoint of step 4 has no checksums (an older attnlab '
      'wrote it); restored unverified.']


def test_every_checkpoint_damaged_stops_every_run_and_moves_none(run):
  _, workdir, abstract_state = run
  for step in (2, 4):
    os.remove(os.path.join(workdir, 'checkpoints', str(step), 'state',
                           '_METADATA'))
  for _ in range(2):  # A rerun finds them where they were.
    checkpointer = checkpointing.Checkpointer(workdir, keep=3)
    with pytest.raises(TrainingError, match='step 4: .*step 2: .*does not '
                       'start again from scratch'):
      checkpointer.restore_latest(abstract_state)
    checkpointer.close()
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == [
      '2', '4', checkpointing.LEDGER]


def bytes_under(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(folder, name))
             for folder, _, names in os.walk(directory) for name in names)


def test_the_space_a_checkpoint_needs_is_what_the_last_one_took(
    run, monkeypatch):
  """A small model's checkpoint is mostly orbax's metadata, the data
  iterator's state and the checksums: its arrays' bytes underestimate it."""
  _, workdir, abstract_state = run
  written = bytes_under(os.path.join(workdir, 'checkpoints', '4'))
  assert checkpointing.state_bytes(abstract_state) < written
  free = (checkpointing.state_bytes(abstract_state) + written) // 2
  monkeypatch.setattr(checkpointing.shutil, 'disk_usage',
                      lambda path: types.SimpleNamespace(free=free))
  checkpointer = checkpointing.Checkpointer(workdir, keep=3)
  try:
    with pytest.raises(InputError, match=(
        'not enough disk space for a checkpoint in .*: one takes '
        f'{written / 2**20:,.1f} MiB')):
      checkpointer.check_space_to_train(abstract_state)
  finally:
    checkpointer.close()


def test_a_run_trained_to_its_end_is_evaluated_again_and_said_complete(
    run, capsys):
  """Nothing is left to train: no sample again, no offer to resume (the
  trainer's part of tests/train/run/test_trainer.py's closing summaries,
  on this module's trained workdir)."""
  config, workdir, _ = run
  capsys.readouterr()
  train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  assert 'Already trained to step 4, evaluated again in ' in out
  assert 'the run is complete: to train it further' in out
  assert '--- sample' not in out


def test_a_reader_verifies_the_parameters_it_restores_alone(run, capsys):
  """train.generate's restore reads the parameters without the optimizer
  state, each checked against its saved checksum: one that does not match
  skips its checkpoint (left where it is: a reader moves nothing)."""
  _, workdir, abstract_state = run
  step_dir = os.path.join(workdir, 'checkpoints', '4')
  os.remove(os.path.join(step_dir, checkpointing.FILE_SIZES))
  sums_path = os.path.join(step_dir, 'checksums', 'metadata')
  with open(sums_path) as f:
    sums = json.load(f)
  name = next(path for path in sums['arrays'] if path.startswith('.params'))
  sums['arrays'][name][0] += 1
  with open(sums_path, 'w') as f:
    json.dump(sums, f)
  step, params = trained_run.restore_params(workdir, abstract_state.params)
  assert step == 2
  chex.assert_trees_all_equal_shapes(params, abstract_state.params)
  assert capsys.readouterr().out == (
      f'warning: the checkpoint of step 4 ({step_dir}) is damaged: the array '
      f'{name} does not match its checksum; skipped.\n')
  assert os.path.isdir(step_dir)


def test_checksums_in_chunks_and_over_shards_are_the_formula_written_out():
  """An array of 2.5 of the chunks summed at a time, held on one device
  (summed chunk by chunk) and sharded over 8 by rows or by columns (summed
  in its shape): each gives the two sums of its bits computed in numpy."""
  size = 5 * checksums.CHUNK // 2
  values = np.random.RandomState(0).randn(size // 16, 16).astype(np.float32)
  bits = values.view(np.uint32).ravel().astype(np.uint64)
  index = np.arange(size, dtype=np.uint64)
  want = [int(np.sum(bits * (2 * index + 1) % 2**32) % 2**32),
          int(np.sum(bits ^ (index * 0x9E3779B9 % 2**32)) % 2**32)]
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  placed = [jax.device_put(values, jax.devices()[0])] + [
      jax.device_put(values, jax.sharding.NamedSharding(mesh, spec))
      for spec in (jax.sharding.PartitionSpec('x'),
                   jax.sharding.PartitionSpec(None, 'x'))]
  for array in placed:
    assert checksums.of_state(array, {})['arrays'] == {'': want}


def test_a_start_resumes_as_a_fresh_run_from_its_parameters(data_dir,
                                                          tmp_path, capsys):
  """A workdir whose checkpoint of step 0 holds parameters alone (an
  import's) trains as a fresh run from those parameters: the same losses,
  bit for bit, its optimizer state made fresh."""
  config = tiny_config('lm_stdlib', data_dir)
  config.update(num_train_steps=2, eval_every=0, checkpoint_every=0,
                sample_length=0)
  program = Program.from_config(config)
  write_start(config, program, datasets.load(program.config, str(tmp_path)),
              program.init().params, str(tmp_path / 'start'))
  train_and_evaluate(config, str(tmp_path / 'start'))
  assert ('Starting from the parameters of the checkpoint at step 0.'
          in capsys.readouterr().out)
  train_and_evaluate(config, str(tmp_path / 'fresh'))
  losses = lambda run: [line['loss'] for line in metrics.read_metrics(
      str(tmp_path / run / 'metrics.jsonl')) if 'loss' in line]
  assert losses('start') == losses('fresh') and len(losses('fresh')) == 1


def test_small_replicated_arrays_are_saved_whole_and_large_ones_in_slices(
    tmp_path):
  """Under use_array_handler (as a Checkpointer starts), orbax's
  replica-parallel save compiles a slicing program per shape only for
  arrays of MIN_REPLICA_SLICE_BYTES a device or more; the others are
  written whole. Either way orbax records each array's metadata and the
  arrays restore as saved."""
  checkpointing.use_array_handler()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rows = checkpointing.MIN_REPLICA_SLICE_BYTES * len(jax.devices()) // 4 // 8
  trees = {'small': {f'w{i}': np.full((8 + i, 4), i, np.float32)
                     for i in range(3)},
           'large': {'w': np.ones((rows, 8), np.float32)}}
  compiles = []
  listener = lambda event, *_, **__: compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for name, tree in trees.items():
      tree = jax.device_put(tree, replicated)
      compiles.clear()
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / name, tree)
      backend = [e for e in compiles if e.endswith('backend_compile_duration')]
      assert bool(backend) == (name == 'large'), (name, backend)
      assert os.listdir(tmp_path / name / 'array_metadatas')
      with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / name, tree)
      chex.assert_trees_all_equal(restored, tree)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def test_a_resume_on_another_mesh_says_it_is_not_bit_for_bit(trained):
  """A checkpoint records the mesh it was saved from; a resume on another
  says that bitwise equality holds on that one only, and on the same
  says nothing."""
  config, workdir = trained
  saved = checkpointing.Checkpointer(workdir, keep=2,
                                     read_only=True).saved_mesh(4)
  assert saved == dict(Program.from_config(config).mesh.shape)
  assert trainer.relaid(saved, saved) is None
  relaid = dict(saved, data=2, fsdp=4)
  assert trainer.relaid(saved, relaid) == (
      f'The checkpoint was saved on {trainer.mesh_shown(saved)} and resumes '
      'on data 2 x fsdp 4: from here the run equals one never interrupted '
      'to float32 rounding (its sums run in another order), not bit for '
      'bit, which holds where a run resumes on the layout it was saved '
      'from.')
