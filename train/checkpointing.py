"""Checkpoints of the train state and the data iterator, with orbax.

Saves are asynchronous; orbax writes each checkpoint under a temporary name
and renames it when complete, so only complete checkpoints are ever found.
Every process takes part in saving its shards of the state, and a state is
restored into whatever shardings the caller asks for: a checkpoint written
on one mesh resumes on another. The data iterator's position is the same on
every host (see train/data/pipeline.py) and is saved once, as JSON, so it
too resumes with any number of hosts.
"""

import os

import grain
import orbax.checkpoint as ocp

from train.steps import TrainState


class Checkpointer:
  """The checkpoints in `workdir/checkpoints`, keeping the last `keep`."""

  def __init__(self, workdir: str, *, keep: int):
    self._manager = ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), 'checkpoints'),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_handlers={'state': ocp.StandardCheckpointHandler(),
                       'data': ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

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
    """Starts saving; returns once the arrays are copied off the device."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_iterator.get_state())))

  def close(self) -> None:
    """Waits for any save in flight to finish."""
    self._manager.wait_until_finished()
    self._manager.close()
