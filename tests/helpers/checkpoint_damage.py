"""A bit flipped in a checkpoint, on a disk or an object store, where
orbax then reads other values without an error: the damage only the
checkpoint's checksums catch."""

import jax
import numpy as np
import orbax.checkpoint as ocp

from train.base import storage


def orbax_restore(workdir: str, step: int, abstract_state) -> list:
  """The arrays orbax restores, without any check of ours."""
  manager = ocp.CheckpointManager(
      f'{storage.resolve(workdir)}/checkpoints',
      options=ocp.CheckpointManagerOptions(read_only=True),
      item_handlers={'state': ocp.StandardCheckpointHandler()})
  state = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state)))['state']
  manager.close()
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def _largest_array_file(workdir: str, step: int):
  """The largest file of a checkpoint's array data."""
  state = storage.path(workdir) / 'checkpoints' / str(step) / 'state'
  sizes = {name: size for name, size in storage.files(state).items()
           if '/d/' in f'/{name}'}
  return state / max(sizes, key=sizes.get)


def flip_a_bit_orbax_reads_silently(workdir: str, step: int,
                                    abstract_state) -> None:
  """Flips one bit of an array file where orbax then restores other values
  without an error (the data is compressed: not every byte is read)."""
  want = orbax_restore(workdir, step, abstract_state)
  path = _largest_array_file(workdir, step)
  data = bytearray(path.read_bytes())
  for fraction in np.linspace(0.05, 0.95, 19):
    data[int(len(data) * fraction)] ^= 0x04
    path.write_bytes(bytes(data))
    try:
      got = orbax_restore(workdir, step, abstract_state)
    except Exception:  # Unreadable after this flip: try another.
      got = want
    if any(not np.array_equal(g, w) for g, w in zip(got, want)):
      return
    data[int(len(data) * fraction)] ^= 0x04  # Undone.
  path.write_bytes(bytes(data))
  raise AssertionError(f'no flipped bit of {path} changed what orbax reads')
