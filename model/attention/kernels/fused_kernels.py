"""The fused kernels that model/attention/kernels/fused.py chooses among, each
called as `dense` would be: cuDNN's, Pallas splash attention (TPU) and
Pallas flash attention (GPU), with the project's general kernel (flex.py)
for score functions and, on a GPU, block-sparse patterns. Under a mesh
each runs in a `shard_map` that splits the batch and the heads as the
model's arrays are split (`over_shards`). Rows that see no key give
zeros, as `dense` does.
"""

import dataclasses
import functools
import math

from flax import linen as nn
import jax
from jax.experimental.pallas.ops.gpu import attention as pallas_gpu_ops
from jax.experimental.pallas.ops.tpu import splash_attention as splash_ops
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from model.attention import core
from model.attention.core import logical_axes, patterns
from model.attention.kernels import cudnn_packed, flex, flex_gpu, flex_tpu

Array = jax.Array
# A padding id no packed row uses.
_PAD_ID = np.iinfo(np.int32).min


def rows_with_keys(valid_BxS: Array, q_len: int, *, is_causal: bool,
                   window: int | None) -> Array:
  """[B, T] bool: whether query t sees any key that `valid_BxS` marks,
  under causality (bottom-right, as `core.causal_mask`) and the window.
  From prefix sums: O(B * (T + S))."""
  kv_len = valid_BxS.shape[1]
  diagonal = np.arange(q_len) + kv_len - q_len
  last = diagonal if is_causal else np.full(q_len, kv_len - 1)
  first = np.zeros(q_len, np.int64)
  if window:
    first = diagonal - window + 1
    if not is_causal:
      last = np.minimum(last, diagonal + window - 1)
  return patterns.any_between(valid_BxS, first, last)


def _zero_rows(out_BxTxNxH: Array, rows_BxT: Array) -> Array:
  return jnp.where(rows_BxT[:, :, None, None], out_BxTxNxH, 0).astype(
      out_BxTxNxH.dtype)


def _key_valid(mask: Array, batch: int) -> Array:
  """A key padding mask [B?, 1, 1, S] as [B, S]."""
  return jnp.broadcast_to(mask[:, 0, 0, :], (batch, mask.shape[-1]))


def cudnn_attention(query: Array, key: Array, value: Array, bias, mask, *,
                    scale: float, is_causal: bool, window: int | None,
                    pattern=None, logit_cap: float = 0.0, sinks=None,
                    routing=None, implementation: str = 'cudnn') -> Array:
  """cuDNN's fused attention (tests run the same call with `implementation`
  'xla'). A key padding mask goes in as each row's number of keys, which is
  the mask only where rows are padded on the right (as every pipeline of
  train/data pads them): a row padded anywhere else comes out NaN, loudly,
  rather than differing from dense. A row with no key at all comes out 0,
  as from dense. Packed rows go in as cuDNN's packed layout."""
  # Refused (fused.py).
  assert (pattern is None and not logit_cap and sinks is None
          and routing is None)
  if isinstance(mask, core.SegmentMask):
    return cudnn_packed.attention(
        query, key, value, mask.q_segment_ids_BxT, scale=scale,
        is_causal=is_causal, max_segments=mask.max_segments)
  kwargs = {}
  if window:
    kwargs['local_window_size'] = (window - 1, 0)
  if mask is not None:
    valid = _key_valid(mask, query.shape[0])
    lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)
    right_padded = jnp.all(
        valid == (jnp.arange(valid.shape[1]) < lengths[:, None]), axis=1)
    kwargs['key_value_seq_lengths'] = jnp.maximum(lengths, 1)
  out = jax.nn.dot_product_attention(
      query, key, value, bias=bias, scale=scale, is_causal=is_causal,
      implementation=implementation, **kwargs)
  if mask is None:
    return out
  out = _zero_rows(out, jnp.broadcast_to((lengths > 0)[:, None],
                                         query.shape[:2]))
  return jnp.where(right_padded[:, None, None, None], out, jnp.nan).astype(
      out.dtype)


def _padded_length(length: int, block: int) -> int:
  return -(-length // block) * block


def _segment_ids(mask, batch: int, q_len: int, kv_len: int,
                 padded_q: int, padded_kv: int):
  """(query ids [B, padded T], key ids [B, padded S]) that keep apart what
  the mask keeps apart and exclude the padded keys; None where no ids are
  needed. Padded queries see only padded keys (or, under a key padding
  mask, the real ones) and are dropped."""
  if isinstance(mask, core.SegmentMask):
    ids = jnp.pad(mask.q_segment_ids_BxT.astype(jnp.int32),
                  ((0, 0), (0, padded_q - q_len)), constant_values=_PAD_ID)
    return ids, ids
  if mask is None and padded_kv == kv_len:
    return None
  valid = (jnp.ones((batch, kv_len), bool) if mask is None
           else _key_valid(mask, batch))
  kv_ids = jnp.pad(jnp.where(valid, 0, 1),
                   ((0, 0), (0, padded_kv - kv_len)), constant_values=1)
  return jnp.zeros((batch, padded_q), jnp.int32), kv_ids.astype(jnp.int32)


def splash_tiles(length: int, pattern) -> tuple[int, int]:
  """(the length splash takes, padded to a multiple of 128; its block
  along it): the largest of 512, 256, 128 dividing it, 128 under a
  block-sparse pattern, whose blocks small ones skip."""
  padded = _padded_length(length, 128)
  return padded, next(block for block in (512, 256, 128)
                      if padded % block == 0
                      and (pattern is None or block == 128))


@dataclasses.dataclass(frozen=True)
class PatternMask(splash_ops.Mask):
  """A block-sparse pattern (patterns.py), causal or not, as splash's mask of
  `size` (queries, keys): each of its blocks read from the pattern's
  predicate as splash asks for it."""

  size: tuple[int, int]
  pattern: patterns.Pattern
  is_causal: bool

  @property
  def shape(self) -> tuple[int, int]:
    return self.size

  def __getitem__(self, index) -> np.ndarray:
    rows, columns = index
    q = np.arange(self.size[0])[rows][:, None]
    k = np.arange(self.size[1])[columns][None, :]
    allowed = np.broadcast_to(self.pattern.allowed(q, k),
                              (q.shape[0], k.shape[1]))
    return allowed & (k <= q) if self.is_causal else allowed


def splash(query, key, value, bias, mask, *, scale, is_causal, window,
           pattern=None, logit_cap=0.0, sinks=None, routing=None):
  """Splash attention, vmapped over the batch; queries and keys padded to
  multiples of 128 (the TPU's lanes); local's window as its LocalMask, a
  block-sparse pattern as a PatternMask. Under a score function, a cap,
  sinks or moba's routing ([B, N, T, k] chosen blocks), and under key
  padding a pattern that cannot say which queries see no key (no
  `sees_keys`), the project's general kernel (flex_tpu.py)."""
  if (bias is not None or logit_cap or sinks is not None
      or routing is not None) or (
      pattern is not None and not hasattr(pattern, 'sees_keys')
      and mask is not None and not isinstance(mask, core.SegmentMask)):
    return _general(flex_tpu.attention, query, key, value, bias, mask,
                    scale=scale, is_causal=is_causal, window=window,
                    pattern=pattern, logit_cap=logit_cap, sinks=sinks,
                    routing=routing)
  batch, q_len, num_heads, _ = query.shape
  kv_len = key.shape[1]
  (padded_q, block_q), (padded_kv, block_kv) = (
      splash_tiles(q_len, pattern), splash_tiles(kv_len, pattern))
  shape = (padded_q, padded_kv)
  if pattern is not None:
    one_mask = PatternMask(shape, pattern, is_causal)
  elif window:
    one_mask = splash_ops.LocalMask(
        shape, (window - 1, 0 if is_causal else window - 1), offset=0)
  elif is_causal:
    one_mask = splash_ops.CausalMask(shape)
  else:
    one_mask = splash_ops.FullMask(shape)
  blocks = splash_ops.BlockSizes(
      block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
      block_q_dkv=block_q, block_kv_dkv=block_kv,
      block_kv_dkv_compute=block_kv, block_q_dq=block_q, block_kv_dq=block_kv)
  kernel = splash_ops.make_splash_mha(
      splash_ops.MultiHeadMask([one_mask] * num_heads), block_sizes=blocks,
      head_shards=1, q_seq_shards=1,
      interpret=jax.default_backend() == 'cpu')
  # Splash takes no scale: the queries are scaled in float32 first.
  q = (query.astype(jnp.float32) * scale).astype(query.dtype)
  heads_first = lambda x, length: jnp.transpose(
      flex.pad_length(x, length), (0, 2, 1, 3))
  q = heads_first(q, padded_q)
  k, v = heads_first(key, padded_kv), heads_first(value, padded_kv)
  ids = _segment_ids(mask, batch, q_len, kv_len, padded_q, padded_kv)
  if ids is None:
    out = _without_x64(jax.vmap(kernel))(q, k, v)
  else:
    out = _without_x64(jax.vmap(lambda q, k, v, q_ids, kv_ids: kernel(
        q, k, v, segment_ids=splash_ops.SegmentIds(q_ids, kv_ids))))(
            q, k, v, *ids)
  out = jnp.transpose(out, (0, 2, 1, 3))[:, :q_len]
  if mask is None or isinstance(mask, core.SegmentMask):
    return out  # Every query sees a key (itself, under segments).
  valid = _key_valid(mask, batch)
  return _zero_rows(out, rows_with_keys(
      valid, q_len, is_causal=is_causal, window=window) if pattern is None
                    else pattern.sees_keys(valid, is_causal))


def _pallas_gpu_length(length: int) -> int:
  """The length padded for the Triton kernel, whose blocks are powers of
  two up to 128 dividing it."""
  if length <= 128:
    return max(16, 1 << (length - 1).bit_length())
  return _padded_length(length, 128)


def _general(attend, query, key, value, bias, mask, *, scale, is_causal,
             window, pattern, logit_cap, sinks, routing):
  """The general kernel `attend` (flex_gpu's or flex_tpu's `attention`):
  the mask as segment ids, local's window as its pattern."""
  batch, length = query.shape[:2]
  ids = _segment_ids(mask, batch, length, length, length, length)
  return attend(
      query, key, value, score=bias,
      pattern=patterns.Window(window) if window else pattern, scale=scale,
      is_causal=is_causal, logit_cap=logit_cap, sinks=sinks,
      routing=routing,
      **({} if ids is None else dict(q_ids_BxT=ids[0], kv_ids_BxT=ids[1])))


def pallas_gpu(query, key, value, bias, mask, *, scale, is_causal, window,
               pattern=None, logit_cap=0.0, sinks=None, routing=None):
  """The Pallas (Triton) flash attention; self-attention only. Under a
  score function, a cap, sinks, a window, a block-sparse pattern (moba's
  routed one with its `routing`) or key padding, the project's general
  kernel (flex_gpu.py)."""
  if (bias is not None or logit_cap or sinks is not None or window
      or pattern is not None
      or (mask is not None and not isinstance(mask, core.SegmentMask))):
    return _general(flex_gpu.attention, query, key, value, bias, mask,
                    scale=scale, is_causal=is_causal, window=window,
                    pattern=pattern, logit_cap=logit_cap, sinks=sinks,
                    routing=routing)
  batch, length, num_heads, _ = query.shape
  padded = _pallas_gpu_length(length)
  block = min(128, padded)
  blocks = pallas_gpu_ops.BlockSizes(
      block_q=block, block_k=block, block_q_dkv=min(32, block),
      block_kv_dkv=min(32, block), block_q_dq=min(32, block),
      block_kv_dq=min(32, block))
  group = num_heads // key.shape[2]
  key, value = (jnp.repeat(flex.pad_length(x, padded), group, axis=2)
                for x in (key, value))
  ids = _segment_ids(mask, batch, length, length, padded, padded)
  if ids is not None:  # One array for queries and keys: the keys'.
    ids = ids[1]
  out = _without_x64(functools.partial(
      pallas_gpu_ops.mha, sm_scale=scale, causal=is_causal,
      block_sizes=blocks, interpret=jax.default_backend() == 'cpu'))(
          flex.pad_length(query, padded), key, value, ids)
  return out[:, :length]


def _without_x64(fn):
  """fn(*arrays), traced forward and backward with x64 off: JAX's own
  kernels (Triton flash attention, splash under grouped heads) divide
  int32 program ids by Python ints, which x64 makes int64, and lax.div
  refuses the mix. Without x64, `fn` as it is (the path the devices run).
  """
  if not jax.config.jax_enable_x64:
    return fn

  @jax.custom_vjp
  def call(*args):
    with jax.enable_x64(False):
      return fn(*args)

  def forward(*args):
    with jax.enable_x64(False):
      return jax.vjp(fn, *args)

  def backward(pull_back, d_out):
    with jax.enable_x64(False):
      return pull_back(d_out)

  call.defvjp(forward, backward)
  return call


def split_axes(logical: str) -> tuple[str, ...]:
  """The axes of the mesh in context, of size > 1 and not already manual,
  that the logical axis `logical` maps to under the rules in context
  (`nn.logical_axis_rules`, the rules the model's own arrays follow)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  target = nn.logical_to_mesh_axes((logical,))[0]
  names = (target,) if isinstance(target, str) else tuple(target or ())
  return tuple(name for name in names if mesh.shape.get(name, 1) > 1
               and name not in mesh.manual_axes)


def _shards(axes: tuple[str, ...]) -> int:
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[name] for name in axes)


def over_shards(fn, query: Array, key: Array, value: Array, bias, mask,
                sinks: Array | None = None, routing: Array | None = None):
  """fn(query, key, value, bias, mask, sinks, routing) with each device
  taking its examples and its heads (and those heads' sinks [N] and
  moba's routing [B, N, T, k], where given), where
  the mesh in context splits them as the model's
  activations (logical_axes.BATCH) and projections (HEADS, KV_HEADS) are:
  a kernel XLA cannot split runs in a `shard_map`, and nothing is gathered.
  The heads are split only where query and key/value heads go to the same
  mesh axes and both divide evenly (a query head must find its key/value
  head on its own device); else each device takes every head of its
  examples."""
  batch_axes = split_axes(logical_axes.BATCH)
  if query.shape[0] % _shards(batch_axes):
    batch_axes = ()
  head_axes = split_axes(logical_axes.HEADS)
  if (split_axes(logical_axes.KV_HEADS) != head_axes
      or set(head_axes) & set(batch_axes)
      or query.shape[2] % _shards(head_axes)
      or key.shape[2] % _shards(head_axes)):
    head_axes = ()
  if not batch_axes and not head_axes:
    return fn(query, key, value, bias, mask, sinks, routing)
  rows = P(batch_axes or None)
  heads = P(batch_axes or None, None, head_axes or None)

  def spec(array):
    """A mask or bias [B?, N?, T, S], each axis split if not broadcast."""
    return P((batch_axes or None) if array.shape[0] > 1 else None,
             (head_axes or None) if array.shape[1] > 1 else None)

  def bias_spec_of(bias):
    """A score function's data: each axis split as its role says."""
    if not isinstance(bias, core.PositionBias):
      return spec(bias)
    split = {'batch': batch_axes or None, 'head': head_axes or None}
    return dataclasses.replace(bias, data={
        name: P(*(split.get(role) if jnp.shape(bias.data[name])[axis] > 1
                  else None for axis, role in enumerate(roles)))
        for name, roles in bias.axes})

  mask_spec = (jax.tree.map(lambda _: rows, mask)
               if isinstance(mask, core.SegmentMask)
               else None if mask is None else spec(mask))
  bias_spec = None if bias is None else bias_spec_of(bias)
  sinks_spec = None if sinks is None else P(head_axes or None)
  routing_spec = None if routing is None else P(batch_axes or None,
                                                head_axes or None)
  return jax.shard_map(
      fn, in_specs=(heads, heads, heads, bias_spec, mask_spec, sinks_spec,
                    routing_spec),
      out_specs=heads, axis_names=set(batch_axes + head_axes),
      check_vma=False)(query, key, value, bias, mask, sinks, routing)
