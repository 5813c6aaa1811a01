"""`ring`: exact attention with the sequence split over devices.

Ring attention (Liu et al. 2023). Queries, keys and values are split along
the length over the mesh axis `axis` (default 'sequence') of the mesh in
context (`jax.set_mesh`). Each device keeps its block of queries; the blocks
of keys and values travel round the ring of devices with `ppermute`, one hop
a step, and each device folds every block that visits into its queries'
online softmax (that of `chunked`). After n steps every query has met every
key, and no device ever held more than its own block and the one in flight.
Under a causal mask the blocks wholly after a device's queries are computed
and masked out rather than skipped: the ring advances in lockstep, so the
last device, which needs every block, sets the pace either way.

Only the sequence axis is manual inside the `shard_map`: the batch and head
dims keep whatever sharding the compiler gave them (data, FSDP, tensor). With
no mesh in context, or none with `axis` of size > 1, the ring has one device
and this is dense attention computed blockwise in one block. The mesh's axes
may be Auto (as `train/program/mesh.py` makes them) or Explicit
(`jax.make_mesh`'s default): under an Explicit `axis` the inputs are
resharded along the length before the ring, and under any Explicit axis the
output is resharded as the queries are, so that the function, and its
gradients, keep the types of its inputs. (Under Explicit axes XLA gathers
the batch over its other axes at the shard_map's boundary, which the Auto
axes of a training run do not: exact, but slower there.)

Masks and array biases are split by query rows, each device holding its rows
against every key (a [B, 1, 1, S] padding mask is O(S) on each); a
SegmentMask holds its queries' ids and every key's, and a PositionBias its
(replicated) data, each computed block by block.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from model.attention import core
from model.attention.core import online_softmax

Array = jax.Array


def _columns(x: Array | None, start: Array, size: int) -> Array | None:
  """Keys [start, start + size) of x's last axis, unless it broadcasts."""
  if x is None or x.shape[-1] == 1:
    return x
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=-1)


def _ring_body(query, key, value, bias, mask, sinks, *, scale: float,
               is_causal: bool, axis: str, ring_size: int):
  """One device's share: queries [B, t, N, H] of block i against the key
  blocks that pass round the ring, with `sinks` [N] (or None) in their
  normaliser; returns its output [B, t, N, H]."""
  batch, block, num_heads, head_dim = query.shape
  num_kv_heads = key.shape[2]
  group = num_heads // num_kv_heads
  index = 0
  if ring_size > 1:
    index = jax.lax.axis_index(axis)
    # Inputs the same on every device (a bias without query rows, a
    # PositionBias's data) become per-device values here, once: their
    # gradients are then summed over the ring once, not at every step.
    bias, mask, sinks = jax.tree.map(lambda x: _per_device(x, axis),
                                     (bias, mask, sinks))
  q_BxKxGxTxH = jnp.transpose(
      query.reshape(batch, block, num_kv_heads, group, head_dim),
      (0, 2, 3, 1, 4)).astype(jnp.float32)
  q_positions = index * block + jnp.arange(block)
  bias = (bias if isinstance(bias, core.PositionBias)
          else online_softmax.split_heads(bias, num_kv_heads))
  segments = isinstance(mask, core.SegmentMask)
  if not segments:
    mask = online_softmax.split_heads(mask, num_kv_heads)

  def fold(stats, k_blk, v_blk, source):
    """Folds the key block that started on device `source` into `stats`."""
    k_positions = source * block + jnp.arange(block)
    logits = jnp.einsum('bkgth,bckh->bkgtc', q_BxKxGxTxH,
                        k_blk.astype(jnp.float32)) * scale
    if isinstance(bias, core.PositionBias):
      logits = bias.apply(logits.reshape(batch, num_heads, block, block),
                          q_positions[:, None], k_positions[None, :]
                          ).reshape(logits.shape)
    elif bias is not None:
      logits = logits + _columns(bias, source * block, block).astype(
          jnp.float32)
    valid = jnp.ones((block, block), bool)
    if is_causal:
      valid = k_positions[None, :] <= q_positions[:, None]
    if segments:
      valid = valid & online_softmax.split_heads(
          mask.at(jnp.arange(block)[:, None], k_positions[None, :]),
          num_kv_heads)
    elif mask is not None:
      valid = valid & _columns(mask, source * block, block)
    return online_softmax.step(
        stats, jnp.where(valid, logits, -jnp.inf), v_blk)

  # Recompute each step's logits in the backward pass rather than keep them:
  # the saved residuals are the key blocks, O(S) per device.
  fold = jax.checkpoint(fold)

  def step(carry, hop):
    """Receives the next key block from the device before; folds it in."""
    stats, k_blk, v_blk = carry
    k_blk, v_blk = jax.lax.ppermute(
        (k_blk, v_blk), axis,
        perm=[(j, (j + 1) % ring_size) for j in range(ring_size)])
    stats = fold(stats, k_blk, v_blk, (index - hop) % ring_size)
    return (stats, k_blk, v_blk), None

  stats = online_softmax.init(
      (batch, num_kv_heads, group, block), head_dim,
      online_softmax.sinks_by_group(sinks, num_kv_heads))
  if ring_size > 1:  # The statistics differ from device to device.
    stats = jax.tree.map(lambda x: _per_device(x, axis), stats)
  stats = fold(stats, key, value, index)  # The device's own block first.
  if ring_size > 1:
    (stats, _, _), _ = jax.lax.scan(step, (stats, key, value),
                                    jnp.arange(1, ring_size))
  out, _ = online_softmax.result(stats)
  out = jnp.transpose(out, (0, 3, 1, 2, 4))
  return out.reshape(batch, block, num_heads, head_dim).astype(query.dtype)


def _per_device(x: Array, axis: str) -> Array:
  if axis in jax.typeof(x).manual_axis_type.varying:
    return x
  return jax.lax.pcast(x, axis, to='varying')


def _ring_size(axis: str) -> int:
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or axis not in mesh.axis_names:
    return 1
  return mesh.shape[axis]


def _axis_types() -> dict[str, AxisType]:
  mesh = jax.sharding.get_abstract_mesh()
  return dict(zip(mesh.axis_names, mesh.axis_types))


def _reshard(x: Array, spec: P, axis: str) -> Array:
  """x split over `axis` where `spec` says, and as its type says on the
  other dims (less `axis`): under an Explicit axis a shard_map's operands
  must already be split as its in_specs say, or their cotangents come back
  with another type than theirs."""
  have = tuple(jax.typeof(x).sharding.spec)
  have += (None,) * (x.ndim - len(have))
  want = tuple(spec) + (None,) * (x.ndim - len(spec))

  def entry(have_d, want_d):
    if want_d == axis:
      return axis
    names = have_d if isinstance(have_d, tuple) else (have_d,)
    names = tuple(name for name in names if name not in (None, axis))
    return names or None

  return jax.sharding.reshard(x, P(*map(entry, have, want)))


def _row_spec(x, axis: str):
  """A mask or bias [B?, N?, T?, S?] split by query rows where it has them
  (a SegmentMask: its query ids)."""
  if x is None:
    return None
  if isinstance(x, core.PositionBias):
    return jax.tree.map(lambda _: P(), x)
  if isinstance(x, core.SegmentMask):
    return core.SegmentMask(P(None, axis), P())
  return P(None, None, axis if x.shape[2] != 1 else None, None)


def ring_attention(query: Array, key: Array, value: Array,
                   bias: Array | None = None, mask: Array | None = None, *,
                   scale: float | None = None, is_causal: bool = False,
                   axis: str = 'sequence', sinks: Array | None = None
                   ) -> Array:
  """`scaled_dot_product_attention`, exactly, the length split over `axis`.

  Self-attention only (S == T); T must divide evenly over the axis.

  Args:
    axis: the mesh axis the sequence is split over.
    sinks: as dense's.
  """
  core.check_inputs(query, key, value, bias, mask)
  core.check_sinks(sinks, query.shape[2])
  length = query.shape[1]
  if key.shape[1] != length:
    raise ValueError(
        f'ring attention needs as many keys as queries (S == T), got '
        f'T={length}, S={key.shape[1]}.')
  ring_size = _ring_size(axis)
  if length % ring_size:
    raise ValueError(
        f'length {length} does not split evenly over the {ring_size} '
        f'devices of mesh axis {axis!r}.')
  body = functools.partial(
      _ring_body, scale=1.0 / math.sqrt(query.shape[-1]) if scale is None
      else scale, is_causal=is_causal, axis=axis, ring_size=ring_size)
  if ring_size == 1:
    return body(query, key, value, bias, mask, sinks)
  if isinstance(mask, core.SegmentMask):  # Every key's ids on each device.
    mask = core.SegmentMask(mask.q_segment_ids_BxT, mask.kv_ids)
  sequence = P(None, axis)
  in_specs = (sequence, sequence, sequence, _row_spec(bias, axis),
              _row_spec(mask, axis), None if sinks is None else P())
  inputs = (query, key, value, bias, mask, sinks)
  axis_types = _axis_types()
  if axis_types[axis] == AxisType.Explicit:
    inputs = jax.tree.map(lambda spec, x: _reshard(x, spec, axis), in_specs,
                          inputs, is_leaf=lambda x: isinstance(x, P))
  out = jax.shard_map(body, in_specs=in_specs, out_specs=sequence,
                      axis_names={axis})(*inputs)
  if AxisType.Explicit in axis_types.values():
    # Split as the queries are, on the Explicit axes (batch, heads).
    out = jax.sharding.reshard(out, jax.typeof(query).sharding.spec)
  return out
