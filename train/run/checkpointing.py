"""Checkpoints of the train state and the data iterator, with orbax.

Saves are asynchronous; orbax writes each checkpoint under a temporary name
(`<step>.orbax-checkpoint-tmp`) and renames it when complete, so only
complete checkpoints are ever restored; on an object store, where a rename
is a copy, it writes `<step>` and commits it by writing the file
`commit_success.txt` last. One left behind by a run killed mid-save is
reported and deleted when the next run starts. Where the run holds the
workdir's lease (train/run/workdir.py), every write of a checkpoint (its
start, the wait for it, its record of file sizes, the deletion of
checkpoints older than the last `keep`) goes through storage.bounded,
which makes it only while the lease is known to hold, and orbax commits a
save in flight only then: one that outlived the lease stays incomplete.
A save that fails
(a full disk, a lost mount) stops the run with a TrainingError naming the
step and the last complete checkpoint; there is no silent loss. On an
object store, each wait on it (a save started, waited for, orbax closed)
lasts at most storage.timeout_s() seconds: past it, the store did not
answer, and the same holds (StoreFailure).

Every process takes part in saving its shards of the state, and a state is
restored into whatever shardings the caller asks for: a checkpoint written
on one mesh resumes on another. The data iterator's position is kept row
by row of the batch (see train/data/pipeline.py), each host's iterator
holding its own rows': the hosts' are gathered and saved once, as JSON,
and every host restores its rows from it, so it too resumes with any
number of hosts.

Each checkpoint also holds checksums (item `checksums`, train/run/
checksums.py): two 32-bit sums of each array's bits, weighted by position,
computed on the devices where the arrays are (a single flipped bit changes
the first), and a SHA-256 of the data iterator's state; once orbax has
committed it, the size of each of its files is recorded in
`<step>/file_sizes.json`. A restore first checks the
files (none missing or cut), then recomputes and compares the checksums. A
checkpoint that fails, or that orbax cannot read, is reported in one line,
moved to `corrupt_checkpoints/<step>` beside `checkpoints` (never deleted;
on an object store the move copies, then deletes, and a move cut short is
made again by the next run) and the next older one is tried; a workdir
whose every checkpoint is damaged stops the run rather than start it again
from scratch over them.

Deleting files cannot switch the verification off. Each checkpoint's
checksums are also written, before its save starts, to the ledger
`checkpoints/checksums.json`, which a checkpoint that lost its own is
verified against. Only a checkpoint whose orbax metadata, as its commit
wrote it, lists its items without checksums (an older attnlab wrote it)
restores unverified, with a notice; one without checksums and without that
record is damaged.
"""

from collections.abc import Callable
import asyncio
import contextlib
import functools
import itertools
import json
import shutil
from typing import Any

import grain
import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp

from model import layer_stack
from train.base import hosts, quiet, storage
from train.base.errors import (InputError, Stopped, StoreFailure,
                               TrainingError)
from train.data import pipeline
from train.program.steps import TrainState
from train.run import checksums

# Marks orbax's directory of a checkpoint still being written.
INCOMPLETE_SUFFIX = ocp.path.atomicity_types.TMP_DIR_SUFFIX
# Marks a complete checkpoint on an object store, where orbax does not
# rename.
COMMITTED = ocp.path.atomicity_types.COMMIT_SUCCESS_FILE
# Where damaged checkpoints are moved, in the workdir: not inside the
# checkpoints directory, which orbax owns (on an object store it deletes
# every directory there that holds no commit file).
CORRUPT = 'corrupt_checkpoints'
# In a checkpoint's directory: {path: bytes} of its files as written.
FILE_SIZES = 'file_sizes.json'
# In the checkpoints directory: {step: checksums} of the checkpoints saved.
LEDGER = 'checksums.json'
# On one process, the smallest part of a replicated array that orbax's
# replica-parallel save gives each device to write (use_array_handler).
MIN_REPLICA_SLICE_BYTES = 1 << 20


def use_array_handler() -> None:
  """On one process, orbax writes a replicated array smaller than
  MIN_REPLICA_SLICE_BYTES a device whole, from one device, not in a slice
  per device: slicing compiles a program per array shape, seconds at a
  model's first save for its many small arrays (18.7 s against 0.16 for 40
  shapes on 8 CPU devices), and their writes are small. On several hosts
  orbax's own handler stays: its slices spread the writes over the hosts.
  Registers the handler in orbax's registry for the process; idempotent."""
  if jax.process_count() > 1:
    return
  default = ocp.type_handlers.get_type_handler(jax.Array)
  with quiet.library_notices():  # orbax warns that it replaces its own.
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(
            min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
            # The default's store of each array's metadata (orbax's checks
            # of a save, typed keys), which a new handler would lack.
            array_metadata_store=default._array_metadata_store),  # pylint: disable=protected-access
        override=True)


class _CommittedWithinTheLease(ocp.path.atomicity.CommitFileTemporaryPath):
  """orbax's commit of a checkpoint on an object store (its commit file,
  written last), made only while the workdir's lease is known to hold
  (storage.check_lease): a save that outlived it is left uncommitted, as
  a save cut short is, and the run stops at its next wait on it."""

  async def finalize(self):
    try:
      storage.check_lease(str(self.get_final()))
    except Stopped:  # orbax ends the save quietly; the run says why.
      raise asyncio.CancelledError from None
    await super().finalize()


class Damaged(Exception):
  """A checkpoint that cannot be read or fails its checksums; the message
  says what is wrong."""


def _record_file_sizes(step_dir: str) -> None:
  sizes = storage.files(storage.path(step_dir))
  sizes.pop(FILE_SIZES, None)
  storage.write_whole(storage.path(step_dir) / FILE_SIZES,
                      json.dumps(sizes, indent=1, sort_keys=True))


def _missing_or_cut(step_dir: str, exempt: str | None = None) -> str | None:
  """Which file of a checkpoint is missing or not of its written size (None:
  none, or no sizes were recorded: a run killed right after the commit);
  the files of its item `exempt` are not looked for."""
  path = storage.path(step_dir) / FILE_SIZES
  if not path.exists():
    return None
  try:
    written = json.loads(path.read_text())
  except (OSError, ValueError) as error:
    return f'{path} cannot be read ({error})'
  for name, size in written.items():
    if exempt and name.startswith(exempt + '/'):
      continue
    file = storage.path(step_dir) / name
    if not file.is_file():
      return f'{file} is missing'
    if file.stat().length != size:
      return f'{file} has {file.stat().length} bytes, {size} were written'
  return None


def _read_ledger(directory: str) -> dict[str, dict]:
  """The ledger of `directory`: its entries shaped as checksums.of_state gives
  them, none if it is missing or cannot be read (the checkpoints' own
  checksums still verify them)."""
  try:
    ledger = json.loads((storage.path(directory) / LEDGER).read_text())
  except (OSError, ValueError):
    return {}
  if not isinstance(ledger, dict):
    return {}
  return {step: sums for step, sums in ledger.items()
          if isinstance(sums, dict) and isinstance(sums.get('arrays'), dict)
          and isinstance(sums.get('data'), str)}


def _write_ledger(directory: str, step: int, sums: dict) -> None:
  """Adds `step`'s checksums to the ledger, whole or not at all; the steps
  whose checkpoints are gone are dropped."""
  ledger = {name: value for name, value in _read_ledger(directory).items()
            if (storage.path(directory) / name).is_dir()}
  ledger[str(step)] = sums
  # In tree order, as checksums.mismatch reads them.
  storage.write_whole(storage.path(directory) / LEDGER, json.dumps(ledger))


def _placed(tree: Any, saved_as: Any, abstract: Any) -> Any:
  """`tree`, restored in the layout `saved_as`, in `abstract`'s layout and
  shardings (itself where they are one layout). Both layouts are on the
  devices while this runs (donating the saved one would not help: its
  stacked and unstacked arrays share no shape)."""
  if saved_as is abstract:
    return tree
  return jax.jit(lambda tree: layer_stack.relayout(tree, abstract),
                 out_shardings=jax.tree.map(lambda leaf: leaf.sharding,
                                            abstract))(tree)


def state_bytes(state: TrainState) -> int:
  """Bytes of a checkpoint of `state`, arrays or their shapes (all shards,
  all hosts)."""
  return sum(leaf.size * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(state))


def _bytes_written(step_dir: str) -> int:
  """Bytes of the files of a checkpoint (0 where they cannot be listed: a
  damaged one, which its restore reports)."""
  try:
    return sum(storage.files(storage.path(step_dir)).values())
  except OSError:
    return 0


def _megabytes(count: float) -> str:
  return f'{count / 2**20:,.1f} MiB'


class Checkpointer:
  """The checkpoints in `workdir/checkpoints`, keeping the last `keep`.

  The run that trains opens them to write; anything else (a tool reading a
  live run's checkpoints) opens them `read_only`, which leaves a save in
  flight alone and restores parameters only (`restore_params`,
  `restore_latest_params`).
  """

  def __init__(self, workdir: str, *, keep: int, read_only: bool = False):
    self._workdir = storage.resolve(workdir)
    self.directory = f'{self._workdir}/checkpoints'
    self._keep = keep
    storage.check_credentials(self._workdir)  # Before orbax's tensorstore.
    use_array_handler()
    if not read_only:
      self._report_incomplete()
    # A reader is told that its directory is read only: it knows.
    with (quiet.library_notices() if read_only else
          contextlib.nullcontext()):
      self._manager = ocp.CheckpointManager(
          self.directory,
          # The checkpoints past `keep` are deleted by `_finished`, within
          # the lease: orbax would, in a thread of its own, whatever it is.
          options=ocp.CheckpointManagerOptions(
              create=not read_only, read_only=read_only,
              cleanup_tmp_directories=not read_only,
              temporary_path_class=(
                  _CommittedWithinTheLease
                  if storage.is_object_store(self.directory) else None)),
          # A reader restores parameters only: orbax's partial restore is
          # the pytree handler's (the files are the standard handler's).
          item_handlers={'state': (ocp.PyTreeCheckpointHandler()
                                   if read_only else
                                   ocp.StandardCheckpointHandler()),
                         'data': ocp.JsonCheckpointHandler(),
                         'checksums': ocp.JsonCheckpointHandler()})
    self._read_only = read_only
    # The step of the save in flight, if any, and of the last complete one.
    self._saving = None
    self._complete = self._manager.latest_step()
    # Once a save failed, orbax is left as it is (see `_failed`).
    self._abandoned = False

  def _report_incomplete(self) -> None:
    directory = storage.path(self.directory)
    if jax.process_index() != 0 or not directory.is_dir():
      return
    for path in sorted(directory.iterdir()):
      if INCOMPLETE_SUFFIX in path.name or (
          storage.is_object_store(self.directory) and path.name.isdigit()
          and not (path / COMMITTED).exists()):
        print(f'warning: ignoring the incomplete checkpoint {path} (a save '
              'was interrupted); it is deleted.', flush=True)

  def _require_space(self, state: TrainState,
                     error: type[Exception]) -> tuple[int, int]:
    """(bytes of a checkpoint of `state`, bytes free on the disk of the
    fullest host, unbounded on an object store); raises `error` unless the
    checkpoint fits. A checkpoint takes its arrays' bytes, or what the
    last complete one took where that is more (orbax's metadata, the data
    iterator's state and the checksums: most of a small model's)."""
    size = state_bytes(state)
    if storage.is_object_store(self.directory):
      return size, float('inf')
    if self._complete is not None:
      # The largest on any host: the hosts agree whether it fits.
      size = -hosts.minimum_over_hosts(-max(size, _bytes_written(
          f'{self.directory}/{self._complete}')))
    free = hosts.minimum_over_hosts(shutil.disk_usage(self.directory).free)
    if free < size:
      raise error(
          f'not enough disk space for a checkpoint in {self.directory}: one '
          f'takes {_megabytes(size)}, {_megabytes(free)} are free. '
          f'{self._last_complete()}')
    return size, free

  def check_space_to_train(self, abstract_state: TrainState) -> None:
    """Before training: InputError unless one checkpoint fits; a warning
    unless those the run keeps, and one being written, do."""
    size, free = self._require_space(abstract_state, InputError)
    if free < (self._keep + 1) * size and jax.process_index() == 0:
      print(f'warning: {_megabytes(free)} free in {self.directory} holds '
            f'fewer than {self._keep + 1} checkpoints of {_megabytes(size)} '
            '(config.keep_checkpoints and one being written).', flush=True)

  def _last_complete(self) -> str:
    if self._complete is None:
      return 'There is no complete checkpoint yet.'
    return (f'The last complete checkpoint is step {self._complete}; run '
            'the same command to resume from it.')

  def _failed(self, error: Exception, doing: str | None = None
              ) -> TrainingError:
    """The error that stops the run when the save in flight (or `doing`)
    failed: StoreFailure on an object store. Orbax is left as it is from
    then on: its threads may still wait on the store, and its errors would
    hide this one."""
    step, self._saving = self._saving, None
    self._abandoned = True
    failure = (StoreFailure if storage.is_object_store(self.directory)
               else TrainingError)
    return failure(
        f'could not {doing or f"write the checkpoint of step {step}"} in '
        f'{self.directory}: {error}. {self._last_complete()}')

  def _finished(self) -> None:
    """Waits for the save in flight; raises TrainingError if it failed.
    Then deletes the checkpoints older than the last `keep`."""
    if self._saving is None:
      return
    try:
      storage.bounded(self._manager.wait_until_finished, self.directory)
    except Stopped:  # The lease lapsed (storage.bounded).
      raise
    except Exception as error:  # orbax re-raises the writer thread's error.
      raise self._failed(error) from error
    if jax.process_index() == 0:
      step_dir = f'{self.directory}/{self._saving}'
      try:
        storage.bounded(lambda: _record_file_sizes(step_dir), step_dir)
      except Stopped:
        raise
      except Exception as error:  # pylint: disable=broad-except
        # Any error of the store (gcsfs's are not all OSErrors).
        print(f'warning: could not record the file sizes of {step_dir} '
              f'({storage.reason(error)}); its checksums still verify it.',
              flush=True)
    self._complete, self._saving = self._saving, None
    for step in sorted(self._manager.all_steps())[:-self._keep]:
      storage.bounded(functools.partial(self._manager.delete, step),
                      self.directory)

  def latest_step(self) -> int | None:
    """The step of the last complete checkpoint (None: there is none)."""
    return self._complete

  def restore(self, step: int, abstract_state: TrainState,
              data_iterator: grain.DatasetIterator | None = None
              ) -> TrainState:
    """The state saved at `step`, verified against its checksums;
    `data_iterator` (if given) is moved to where it was. Raises Damaged.

    `abstract_state` gives the shapes, dtypes and shardings to restore into,
    and the layout of a Transformer's blocks: a checkpoint saved in the
    other (config.model.scan_layers changed on a resume) is restored and
    verified as saved, then converted (model/layer_stack.py).
    """
    saved_tree = self._saved_tree(step)
    if saved_tree is not None and saved_tree.get('opt_state') is None:
      return self._restore_start(step, abstract_state, saved_tree,
                                 data_iterator)
    saved_as = (abstract_state if saved_tree is None
                else layer_stack.relayout(abstract_state, saved_tree))
    restored = self._read(
        step, ocp.args.StandardRestore(saved_as), data=True,
        mismatch=lambda saved, restored: checksums.mismatch(
            saved, checksums.of_state(restored['state'], restored['data'])))
    if data_iterator is not None:
      data_iterator.set_state(restored['data'])
    return _placed(restored['state'], saved_as, abstract_state)

  def _restore_start(self, step: int, abstract_state: TrainState,
                     saved_tree: dict,
                     data_iterator: grain.DatasetIterator | None
                     ) -> TrainState:
    """A start (`save` of a state without an optimizer state: an import's
    step 0): its parameters and data position, verified; its optimizer
    state None, for the caller to make fresh (Program.start_from)."""
    saved_as = layer_stack.relayout(abstract_state.params,
                                    saved_tree['params'])
    # It holds nothing else: read whole.
    restored = self._read(
        step, ocp.args.StandardRestore(TrainState(
            step=abstract_state.step, params=saved_as, opt_state=None)),
        data=True, mismatch=lambda saved, restored: checksums.mismatch(
            saved, checksums.of_state(restored['state'], restored['data'])))
    if data_iterator is not None:
      data_iterator.set_state(restored['data'])
    return restored['state'].replace(params=_placed(
        restored['state'].params, saved_as, abstract_state.params))

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """The parameters saved at `step`, and nothing else of the state (not
    the optimizer's), read straight into `abstract_params`' shardings and
    dtypes and verified against their checksums; a reader's restore (see
    `restore` for the layout of the blocks). Raises Damaged."""
    saved_tree = self._saved_tree(step)
    saved_as = (abstract_params if saved_tree is None
                else layer_stack.relayout(abstract_params,
                                          saved_tree['params']))
    item = {'params': saved_as}
    restored = self._read(
        step, ocp.args.PyTreeRestore(
            item=item, partial_restore=True,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item)),
        data=False, mismatch=lambda saved, restored: (
            checksums.params_mismatch(saved, restored['state']['params'])))
    return _placed(restored['state']['params'], saved_as, abstract_params)

  def _read(self, step: int, state_args, *, data: bool,
            mismatch: Callable[[dict, dict], str | None]) -> dict:
    """orbax's items of `step`: 'state' read with `state_args`, 'data' if
    `data`, verified by `mismatch(saved checksums, items)` (what differs,
    or None) unless an older attnlab wrote it without checksums. Raises
    Damaged for missing or cut files, what orbax cannot read, checksums
    missing and a mismatch."""
    step_dir = f'{self.directory}/{step}'
    own = (storage.path(step_dir) / 'checksums').is_dir()
    # One that lost its own checksums is verified against the ledger.
    saved = None if own else _read_ledger(self.directory).get(str(step))
    problem = _missing_or_cut(step_dir, exempt=None if saved is None
                              else 'checksums')
    if problem:
      raise Damaged(problem)
    items = {'state': state_args}
    if data:
      items['data'] = ocp.args.JsonRestore()
    if own:
      items['checksums'] = ocp.args.JsonRestore()
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as error:  # orbax's errors have many types.
      lines = str(error).strip().splitlines() or [type(error).__name__]
      raise Damaged(f'orbax cannot read it: {lines[-1][:300]}') from error
    if own:
      saved = restored['checksums']
    if saved is None and not self._written_without_checksums(step):
      raise Damaged(
          'its checksums are missing, the ledger '
          f'{self.directory}/{LEDGER} has no entry for it, '
          "and orbax's metadata does not show it was written without them")
    problem = saved is not None and mismatch(saved, restored)
    if problem:
      raise Damaged(problem)
    if jax.process_index() == 0 and not own:
      print(f'warning: the checkpoint of step {step} has no checksums '
            + ('(an older attnlab wrote it); restored unverified.'
               if saved is None else
               'of its own; verified against the ledger.'), flush=True)
    return restored

  def _saved_tree(self, step: int):
    """orbax's metadata of the state saved at `step`, in its tree (None if
    it cannot be read: the restore then reports what is wrong)."""
    try:
      with quiet.library_notices():
        return self._manager.item_metadata(step)['state'].tree
    except Exception:  # orbax's errors have many types.
      return None

  def saved_mesh(self, step: int) -> dict[str, int] | None:
    """{axis: size} of the mesh the state of `step` was saved from, as
    orbax's metadata records its arrays' shardings (None where it does
    not say)."""
    for leaf in jax.tree.leaves(self._saved_tree(step)):
      sharding = getattr(leaf, 'sharding', None)
      if hasattr(sharding, 'axis_names') and hasattr(sharding, 'shape'):
        return dict(zip(sharding.axis_names, map(int, sharding.shape)))
    return None

  def _written_without_checksums(self, step: int) -> bool:
    """Whether orbax's metadata of `step`, as its commit wrote it, lists
    its items without `checksums`: a checkpoint of an older attnlab. One
    missing or unreadable (no commit time) shows nothing."""
    with quiet.library_notices():  # A missing metadata file is a notice.
      metadata = self._manager.metadata(step)
    return (metadata.commit_timestamp_nsecs is not None
            and 'checksums' not in (metadata.item_handlers or {}))

  def restore_latest(self, abstract_state: TrainState,
                     data_iterator: grain.DatasetIterator | None = None
                     ) -> tuple[int, TrainState] | None:
    """(step, state) of the newest checkpoint that restores and verifies
    on every host (see `restore` and `_newest`); None when there is no
    checkpoint."""
    return self._newest(
        lambda step: self.restore(step, abstract_state, data_iterator))

  def restore_latest_params(self, abstract_params: Any
                            ) -> tuple[int, Any] | None:
    """(step, parameters) of the newest checkpoint whose parameters
    restore and verify on every host (see `restore_params`)."""
    return self._newest(
        lambda step: self.restore_params(step, abstract_params))

  def _newest(self, read: Callable[[int], Any]) -> tuple[int, Any] | None:
    """(step, `read(step)`) of the newest checkpoint that `read` restores
    on every host; None when there is no checkpoint. The damaged ones newer
    than it are reported, and moved to corrupt_checkpoints unless
    `read_only`. When none verifies, nothing is moved (a rerun must not
    find an empty directory and start from scratch): TrainingError naming
    each problem."""
    steps = sorted(self._manager.all_steps(), reverse=True)
    damaged = []
    for step in steps:
      problem = None
      try:
        restored = read(step)
      except Damaged as damage:
        problem = str(damage)
      # Every host restores the same step or none does.
      if not hosts.minimum_over_hosts(problem is None):
        damaged.append((step, problem or 'damaged as another host read it'))
        continue
      for damaged_step, damaged_problem in damaged:
        self._set_aside(damaged_step, damaged_problem)
      self._complete = step
      return step, restored
    if damaged:
      listed = '; '.join(f'step {step}: {problem}'
                         for step, problem in damaged)
      raise TrainingError(
          f'no checkpoint in {self.directory} restores and verifies '
          f'({listed}). They are left where they are and the run does not '
          'start again from scratch over them; move them away to start '
          'anew.')
    return None

  def _set_aside(self, step: int, problem: str) -> None:
    """Reports a damaged checkpoint; unless read-only, moves it to
    corrupt_checkpoints/<step> (a free name: <step>.1, ... if taken); one
    that cannot be moved is left where it is, with a warning."""
    source = storage.path(self.directory) / str(step)
    if self._read_only:
      if jax.process_index() == 0:
        print(f'warning: the checkpoint of step {step} ({source}) is '
              f'damaged: {problem}; skipped.', flush=True)
      return
    corrupt = storage.path(self._workdir) / CORRUPT
    names = (f'{step}.{suffix}' if suffix else str(step)
             for suffix in itertools.count())
    target = next(corrupt / name for name in names
                  if not (corrupt / name).exists())
    if jax.process_index() == 0:
      try:
        storage.move(source, target)
        where = f'moved to {target}'
      except Exception as error:  # pylint: disable=broad-except
        where = f'could not move it to {target} ({error}); left where it is'
      print(f'warning: the checkpoint of step {step} is damaged: {problem}; '
            f'{where}.', flush=True)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'set aside checkpoint {step}')
    self._manager.reload()

  def save(self, step: int, state: TrainState,
           data_iterator: grain.DatasetIterator) -> None:
    """Starts saving; returns once the arrays are copied off the device.

    Raises TrainingError if the previous save failed or if the disk has no
    room for this one.
    """
    self._finished()
    self._require_space(state, TrainingError)
    data_state = data_iterator.get_state()
    if jax.process_count() > 1:
      # Each host's iterator holds the state of its own rows of the batch:
      # a checkpoint holds every row's, to resume on any number of hosts.
      data_state = pipeline.merged_rows(hosts.gathered(data_state))
    sums = checksums.of_state(state, data_state)

    def start() -> None:
      if jax.process_index() == 0:
        try:
          _write_ledger(self.directory, step, sums)
        except Stopped:
          raise
        except Exception as error:  # pylint: disable=broad-except
          print(f'warning: could not add step {step} to the ledger '
                f'{self.directory}/{LEDGER} ({storage.reason(error)}); '
                'its own checksums still verify it.', flush=True)
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=ocp.args.JsonSave(data_state),
          checksums=ocp.args.JsonSave(sums)))

    try:
      storage.bounded(start, self.directory)
    # Creating the directory failed at once, or the store did not answer.
    except OSError as error:
      raise self._failed(
          error, f'write the checkpoint of step {step}') from error
    # In flight only once started: a save interrupted before (a second
    # Ctrl-C) leaves nothing to wait for.
    self._saving = step

  def wait(self) -> int | None:
    """Waits for the save in flight; returns the last complete step."""
    self._finished()
    return self._complete

  def close(self) -> None:
    """Waits for any save in flight to finish, then releases orbax; after
    a failed save, leaves orbax as it is (see `_failed`)."""
    if self._abandoned:
      return
    self._finished()
    try:
      storage.bounded(self._manager.close, self.directory)
    except Stopped:
      raise
    except Exception as error:  # orbax's errors have many types.
      raise self._failed(error, 'close the checkpoints') from error
