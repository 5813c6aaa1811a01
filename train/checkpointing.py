"""Checkpoints of the train state and the data iterator, with orbax.

Saves are asynchronous; orbax writes each checkpoint under a temporary name
(`<step>.orbax-checkpoint-tmp`) and renames it when complete, so only
complete checkpoints are ever restored. One left behind by a run killed
mid-save is reported and deleted when the next run starts. A save that fails
(a full disk, a lost mount) stops the run with a TrainingError naming the
step and the last complete checkpoint; there is no silent loss.

Every process takes part in saving its shards of the state, and a state is
restored into whatever shardings the caller asks for: a checkpoint written
on one mesh resumes on another. The data iterator's position is the same on
every host (see train/data/pipeline.py) and is saved once, as JSON, so it
too resumes with any number of hosts.
"""

import os
import shutil

import grain
import jax
import orbax.checkpoint as ocp

from train import mesh
from train.errors import InputError, TrainingError
from train.steps import TrainState

# Marks orbax's directory of a checkpoint still being written.
INCOMPLETE_SUFFIX = ocp.path.atomicity_types.TMP_DIR_SUFFIX


def state_bytes(state: TrainState) -> int:
  """Bytes of a checkpoint of `state`, arrays or their shapes (all shards,
  all hosts)."""
  return sum(leaf.size * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(state))


def _megabytes(count: float) -> str:
  return f'{count / 2**20:,.1f} MiB'


class Checkpointer:
  """The checkpoints in `workdir/checkpoints`, keeping the last `keep`.

  The run that trains opens them to write; anything else (a tool reading a
  live run's checkpoints) opens them `read_only`, which leaves a save in
  flight alone.
  """

  def __init__(self, workdir: str, *, keep: int, read_only: bool = False):
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    self._keep = keep
    if not read_only:
      self._report_incomplete()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=not read_only, read_only=read_only,
            cleanup_tmp_directories=not read_only),
        item_handlers={'state': ocp.StandardCheckpointHandler(),
                       'data': ocp.JsonCheckpointHandler()})
    # The step of the save in flight, if any, and of the last complete one.
    self._saving = None
    self._complete = self._manager.latest_step()

  def _report_incomplete(self) -> None:
    if jax.process_index() != 0 or not os.path.isdir(self.directory):
      return
    for name in sorted(os.listdir(self.directory)):
      if INCOMPLETE_SUFFIX in name:
        print(f'warning: ignoring the incomplete checkpoint '
              f'{os.path.join(self.directory, name)} (a save was '
              'interrupted); it is deleted.', flush=True)

  def _require_space(self, state: TrainState,
                     error: type[Exception]) -> tuple[int, int]:
    """(bytes of a checkpoint of `state`, bytes free on the disk of the
    fullest host); raises `error` unless the checkpoint fits."""
    size = state_bytes(state)
    free = mesh.minimum_over_hosts(shutil.disk_usage(self.directory).free)
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
    return (f'The last complete checkpoint is step {self._complete}; free '
            'space and run the same command to resume from it.')

  def _failed(self, error: Exception) -> TrainingError:
    """The error that stops the run when the save in flight failed."""
    step, self._saving = self._saving, None
    return TrainingError(
        f'could not write the checkpoint of step {step} in {self.directory}: '
        f'{error}. {self._last_complete()}')

  def _finished(self) -> None:
    """Waits for the save in flight; raises TrainingError if it failed."""
    try:
      self._manager.wait_until_finished()
    except Exception as error:  # orbax re-raises the writer thread's error.
      raise self._failed(error) from error
    if self._saving is not None:
      self._complete, self._saving = self._saving, None

  def latest_step(self) -> int | None:
    """The step of the last complete checkpoint (None: there is none)."""
    return self._complete

  def restore(self, step: int, abstract_state: TrainState,
              data_iterator: grain.DatasetIterator) -> TrainState:
    """The state saved at `step`; `data_iterator` is moved to where it was.

    `abstract_state` gives the shapes, dtypes and shardings to restore into.
    """
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore()))
    data_iterator.set_state(restored['data'])
    return restored['state']

  def restore_state(self, step: int, abstract_state: TrainState
                    ) -> TrainState:
    """The state saved at `step` alone, without a data iterator to move."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state)))
    return restored['state']

  def save(self, step: int, state: TrainState,
           data_iterator: grain.DatasetIterator) -> None:
    """Starts saving; returns once the arrays are copied off the device.

    Raises TrainingError if the previous save failed or if the disk has no
    room for this one.
    """
    self._finished()
    self._require_space(state, TrainingError)
    self._saving = step
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=ocp.args.JsonSave(data_iterator.get_state())))
    except OSError as error:  # Creating the directory failed at once.
      raise self._failed(error) from error

  def wait(self) -> int | None:
    """Waits for the save in flight; returns the last complete step."""
    self._finished()
    return self._complete

  def close(self) -> None:
    """Waits for any save in flight to finish, then releases orbax."""
    try:
      self._finished()
    finally:
      self._manager.close()
