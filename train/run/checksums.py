"""A train state's checksums, which each checkpoint holds and a restore
verifies (see checkpointing.py): two 32-bit sums of each array's bits,
weighted by position, computed on the devices where the arrays are (a
single flipped bit changes the first), and a SHA-256 of the data
iterator's state. A reader of the parameters alone verifies theirs."""

import functools
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp

from train.program.steps import TrainState

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
# The parameters' paths in a state's checksums.
_PARAMS = '.params'

# Elements summed at a time in an array held whole on each of its devices:
# the sums' temporaries are this long, not the array's (the CPU materialises
# an integer reduction's operand: whole arrays' would double a restore's
# peak memory). A sharded array is summed in its own shape, each device
# over its shards (flattening or slicing it would gather it).
CHUNK = 1 << 18


def _sums(x: jax.Array, index: jax.Array) -> jax.Array:
  """[sum of bits * (2i + 1), sum of bits ^ (i * 0x9E3779B9)] mod 2^32 over
  the elements of `x`, `index` (uint32, x's shape) holding each one's i."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  bits = jax.lax.bitcast_convert_type(
      x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)
  return jnp.stack([jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32),
                    jnp.sum(bits ^ (index * jnp.uint32(0x9E3779B9)),
                            dtype=jnp.uint32)])


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
  """Each element's position in row-major order, mod 2^32, in `shape`."""
  index, stride = jnp.zeros(shape, jnp.uint32), 1
  for axis in reversed(range(len(shape))):
    index += (jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
              * jnp.uint32(stride % 2**32))
    stride *= shape[axis]
  return index


@functools.partial(jax.jit, static_argnums=1)
def _array_sums(state, whole: tuple[bool, ...]):
  """Per array, [sum of bits * (2i + 1), sum of bits ^ (i * 0x9E3779B9)]
  mod 2^32 over its elements i (row-major): one flipped bit changes the
  first. The sums do not depend on the order: an array held whole (each
  leaf's `whole`) is summed CHUNK elements at a time, a sharded one in its
  own shape."""
  def sums(x, held_whole):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if not held_whole:
      return _sums(x, _flat_index(x.shape))
    x = x.ravel()
    chunks = x.size // CHUNK
    start = chunks * CHUNK
    total = _sums(x[start:], jnp.uint32(start % 2**32)
                  + jnp.arange(x.size - start, dtype=jnp.uint32))
    if chunks:
      total += jax.lax.fori_loop(
          0, chunks, lambda i, total: total + _sums(
              jax.lax.dynamic_slice(x, (i * CHUNK,), (CHUNK,)),
              (i * CHUNK).astype(jnp.uint32)
              + jnp.arange(CHUNK, dtype=jnp.uint32)),
          jnp.zeros(2, jnp.uint32))
    return total

  leaves, tree = jax.tree.flatten(state)
  return jax.tree.unflatten(tree, list(map(sums, leaves, whole)))


def _arrays_checksums(tree: Any) -> dict[str, list[int]]:
  """{path: [sum, sum]} of a tree's arrays (see _array_sums)."""
  whole = tuple(getattr(leaf, 'sharding', None) is None
                or leaf.sharding.is_fully_replicated
                for leaf in jax.tree.leaves(tree))
  sums = jax.device_get(_array_sums(tree, whole))
  return {jax.tree_util.keystr(path): [int(v) for v in value]
          for path, value in jax.tree_util.tree_leaves_with_path(sums)}


def of_state(state: TrainState, data_state: dict) -> dict:
  """{'arrays': {path: [sum, sum]}, 'data': sha256} of a state and the data
  iterator's state."""
  return {'arrays': _arrays_checksums(state),
          # Over the state as JSON gives it back, keys sorted.
          'data': hashlib.sha256(json.dumps(
              json.loads(json.dumps(data_state)),
              sort_keys=True).encode()).hexdigest()}


def mismatch(saved: dict, got: dict) -> str | None:
  """What differs between saved and recomputed checksums (None: nothing).
  Arrays are compared in tree order, their saved names only said."""
  if len(saved['arrays']) != len(got['arrays']):
    return (f'{len(saved["arrays"])} arrays were saved, '
            f'{len(got["arrays"])} restored')
  for (path, value), got_value in zip(saved['arrays'].items(),
                                      got['arrays'].values()):
    if got_value != value:
      return f'the array {path} does not match its checksum'
  if saved['data'] != got['data']:
    return "the data iterator's state does not match its checksum"
  return None


def params_mismatch(saved: dict, params: Any) -> str | None:
  """What differs between the saved checksums of a state's parameters and
  those of `params`, restored alone (None: nothing)."""
  got = _arrays_checksums(params)
  want = {path[len(_PARAMS):]: value
          for path, value in saved['arrays'].items()
          if path.startswith(_PARAMS)}
  if len(want) != len(got):
    return f'{len(want)} parameter arrays were saved, {len(got)} restored'
  for path, value in got.items():
    if want.get(path) != value:
      return f'the array {_PARAMS}{path} does not match its checksum'
  return None
