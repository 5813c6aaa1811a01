"""Fused attention kernels, and which one computes a case.

`chunked`, and `local` for its window, compute exact attention with one of:

  xla         the blocked JAX code of chunked.py (local: its band of blocks
              in sparse.py); every case, on every backend.
  cudnn       cuDNN's fused attention, `jax.nn.dot_product_attention(
              implementation='cudnn')`; GPU.
  pallas_tpu  Pallas splash attention (`jax.experimental.pallas.ops.tpu.
              splash_attention`); TPU, and the CPU in interpret mode.
  pallas_gpu  Pallas flash attention (`jax.experimental.pallas.ops.gpu.
              attention.mha`); GPU, and the CPU in interpret mode.

A kernel takes a case only where it computes it as `dense` does;
`refusal(kernel, case)` says why it does not. `kernel='auto'` takes the
first kernel of AUTO_ORDER[backend] that computes the case, else xla. A
kernel named explicitly that cannot compute the case raises KernelError:
nothing falls back silently. A `Case` holds only what shapes and types say,
so the choice is made while tracing, and a config's choices can be worked
out before anything is compiled (train/attention_kernels.py).

Under a mesh with more than one device the Pallas kernels run in a
`shard_map` over the mesh axes of the logical axis 'batch'; their inputs are
gathered along every other axis (heads under tensor parallelism, the length
under sequence parallelism), which is exact but repeats their work there.
"""

import dataclasses
import math

from flax import linen as nn
import jax
from jax.experimental.pallas.ops.gpu import attention as pallas_gpu
from jax.experimental.pallas.ops.tpu import splash_attention as splash
import jax.numpy as jnp
import numpy as np

from model.attention import core

Array = jax.Array

KERNELS = ('auto', 'xla', 'cudnn', 'pallas_tpu', 'pallas_gpu')
# The fused kernels 'auto' tries on each backend, in this order; then xla.
AUTO_ORDER = {'tpu': ('pallas_tpu',), 'gpu': ('cudnn', 'pallas_gpu')}
# A padding id no packed row uses.
_PAD_ID = np.iinfo(np.int32).min


class KernelError(ValueError):
  """A kernel named explicitly cannot compute the case at hand."""


@dataclasses.dataclass(frozen=True)
class Case:
  """What an attention call asks of a kernel, as its shapes and types say.

  mask: 'none'; 'segments' (a SegmentMask of self-attention: one id array
    for queries and keys); 'key_padding' (a bool array [B, 1, 1, S]);
    'other' (any other mask).
  bias: 'none', 'array', or 'function' (a PositionBias).
  window: local attention's window (query i sees keys j with |i - j| <
    window; causal: 0 <= i - j < window); None for none.
  """

  backend: str
  dtype: str
  head_dim: int
  q_len: int
  kv_len: int
  is_causal: bool
  mask: str = 'none'
  bias: str = 'none'
  window: int | None = None

  def describe(self) -> str:
    """e.g. 'bfloat16, causal, packed rows'."""
    parts = [self.dtype, 'causal' if self.is_causal else 'bidirectional']
    parts += {'segments': ['packed rows'], 'key_padding': ['padded rows'],
              'other': ['a mask array'], 'none': []}[self.mask]
    parts += {'array': ['a bias array'], 'function': ['a position bias'],
              'none': []}[self.bias]
    if self.window:
      parts.append(f'window {self.window}')
    return ', '.join(parts)


def _mask_kind(mask) -> str:
  """`Case.mask` of a mask argument."""
  if mask is None:
    return 'none'
  if isinstance(mask, core.SegmentMask):
    return 'segments' if mask.kv_segment_ids_BxS is None else 'other'
  return 'key_padding' if mask.shape[1:3] == (1, 1) else 'other'


def case_of(query: Array, key: Array, bias, mask, *, is_causal: bool,
            window: int | None = None) -> Case:
  """The Case of a call on the default backend."""
  if bias is None:
    bias_kind = 'none'
  else:
    bias_kind = 'function' if isinstance(bias, core.PositionBias) else 'array'
  dtype = jnp.dtype(query.dtype).name
  if key.dtype != query.dtype:  # The fused kernels take one dtype.
    dtype += f' queries, {jnp.dtype(key.dtype).name} keys'
  return Case(jax.default_backend(), dtype, query.shape[-1], query.shape[1],
              key.shape[1], is_causal, _mask_kind(mask), bias_kind, window)


def _cudnn_refusal(case: Case) -> str | None:
  if case.backend != 'gpu':
    return 'needs a GPU'
  if case.dtype not in ('bfloat16', 'float16'):
    return f'takes bfloat16 or float16 inputs, not {case.dtype}'
  if case.head_dim > 128 or case.head_dim % 8:
    return (f'takes head dims that are multiples of 8 up to 128, not '
            f'{case.head_dim}')
  if case.is_causal and case.q_len != case.kv_len:
    return ('aligns the causal diagonal top-left, and dense bottom-right, '
            'when queries and keys differ in number')
  if case.mask == 'segments':
    return 'takes no segment ids (packed rows)'
  if case.mask == 'other':
    return 'takes no mask but right padding (a row it masks whole differs)'
  if case.bias == 'function':
    return 'takes a bias array, not a position bias computed by blocks'
  if case.window and not case.is_causal:
    return 'takes a window only under a causal mask'
  if case.window and case.mask == 'key_padding':
    return 'may leave a padded query no key in its window'
  return None


def _pallas_tpu_refusal(case: Case) -> str | None:
  if case.backend not in ('tpu', 'cpu'):
    return 'needs a TPU (or the CPU, interpreted)'
  if case.dtype not in ('float32', 'bfloat16'):
    return f'takes float32 or bfloat16 inputs, not {case.dtype}'
  if case.is_causal and case.q_len != case.kv_len:
    return 'is causal only with as many queries as keys'
  if case.mask == 'other':
    return 'takes segment ids or a key padding mask, not a mask array'
  if case.bias != 'none':
    return 'takes no bias'
  return None


def _pallas_gpu_refusal(case: Case) -> str | None:
  if case.backend not in ('gpu', 'cpu'):
    return 'needs a GPU (or the CPU, interpreted)'
  if case.dtype not in ('float32', 'bfloat16', 'float16'):
    return f'takes float32, bfloat16 or float16 inputs, not {case.dtype}'
  if case.q_len != case.kv_len:
    return ('computes self-attention only (one array of segment ids serves '
            'queries and keys)')
  if case.mask in ('key_padding', 'other'):
    return 'takes segment ids, not a mask array'
  if case.bias != 'none':
    return 'takes no bias'
  if case.window:
    return 'takes no window'
  if case.head_dim > 128:
    return f'takes head dims up to 128, not {case.head_dim}'
  return None


_REFUSALS = {'xla': lambda case: None, 'cudnn': _cudnn_refusal,
             'pallas_tpu': _pallas_tpu_refusal,
             'pallas_gpu': _pallas_gpu_refusal}


def refusal(kernel: str, case: Case) -> str | None:
  """Why `kernel` does not compute `case` as dense does; None if it does."""
  return _REFUSALS[kernel](case)


def choose(kernel: str, case: Case) -> str:
  """The kernel that computes `case`: `kernel` itself, or for 'auto' the
  first of AUTO_ORDER[case.backend] that can, else 'xla'.

  Raises:
    ValueError: `kernel` is not one of KERNELS.
    KernelError: `kernel` was named and cannot compute the case.
  """
  if kernel not in KERNELS:
    raise ValueError(f'kernel={kernel!r} must be one of {list(KERNELS)}.')
  if kernel == 'auto':
    return next((name for name in AUTO_ORDER.get(case.backend, ())
                 if refusal(name, case) is None), 'xla')
  reason = refusal(kernel, case)
  if reason is not None:
    raise KernelError(f'kernel={kernel!r} {reason} ({case.describe()} on '
                      f'{case.backend}).')
  return kernel


def run(kernel: str, query: Array, key: Array, value: Array, bias, mask, *,
        scale: float, is_causal: bool, window: int | None = None) -> Array:
  """Attention [B, T, N, H] by fused `kernel` (as `choose` returned it)."""
  if kernel == 'cudnn':
    return cudnn_attention(query, key, value, bias, mask, scale=scale,
                           is_causal=is_causal, window=window)
  fn = {'pallas_tpu': _splash, 'pallas_gpu': _pallas_gpu}[kernel]
  return _over_batch_shards(
      lambda q, k, v, m: fn(q, k, v, m, scale=scale, is_causal=is_causal,
                            window=window), query, key, value, mask)


def rows_with_keys(valid_BxS: Array, q_len: int, *, is_causal: bool,
                   window: int | None) -> Array:
  """[B, T] bool: whether query t sees any key that `valid_BxS` marks,
  under causality (bottom-right, as `core.causal_mask`) and the window.
  From prefix sums: O(B * (T + S))."""
  kv_len = valid_BxS.shape[1]
  counts = jnp.pad(jnp.cumsum(valid_BxS, axis=1), ((0, 0), (1, 0)))
  diagonal = np.arange(q_len) + kv_len - q_len
  last = diagonal if is_causal else np.full(q_len, kv_len - 1)
  first = np.zeros(q_len, np.int64)
  if window:
    first = diagonal - window + 1
    if not is_causal:
      last = np.minimum(last, diagonal + window - 1)
  first = np.clip(first, 0, kv_len)
  last = np.clip(last, -1, kv_len - 1)
  seen = counts[:, np.maximum(last + 1, first)] - counts[:, first]
  return seen > 0


def _zero_rows(out_BxTxNxH: Array, rows_BxT: Array) -> Array:
  return jnp.where(rows_BxT[:, :, None, None], out_BxTxNxH, 0).astype(
      out_BxTxNxH.dtype)


def _key_valid(mask: Array, batch: int) -> Array:
  """A key padding mask [B?, 1, 1, S] as [B, S]."""
  return jnp.broadcast_to(mask[:, 0, 0, :], (batch, mask.shape[-1]))


def cudnn_attention(query: Array, key: Array, value: Array, bias, mask, *,
                    scale: float, is_causal: bool, window: int | None,
                    implementation: str = 'cudnn') -> Array:
  """cuDNN's fused attention (tests run the same call with `implementation`
  'xla'). A key padding mask goes in as each row's number of keys, which is
  the mask only where rows are padded on the right (as every pipeline of
  train/data pads them): a row padded anywhere else comes out NaN, loudly,
  rather than differing from dense. A row with no key at all comes out 0,
  as from dense."""
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


def _pad_length(x: Array, length: int) -> Array:
  """[B, T, ...] padded with zeros to `length` along T."""
  return jnp.pad(x, [(0, 0), (0, length - x.shape[1])]
                 + [(0, 0)] * (x.ndim - 2))


def _splash_block(length: int) -> int:
  """Splash's block along a length padded to a multiple of 128: the
  largest of 512, 256, 128 dividing it."""
  return next(block for block in (512, 256, 128) if length % block == 0)


def _splash(query, key, value, mask, *, scale, is_causal, window):
  """Splash attention, vmapped over the batch; queries and keys padded to
  multiples of 128 (the TPU's lanes)."""
  batch, q_len, num_heads, _ = query.shape
  kv_len = key.shape[1]
  padded_q, padded_kv = _padded_length(q_len, 128), _padded_length(kv_len, 128)
  shape = (padded_q, padded_kv)
  if window:
    one_mask = splash.LocalMask(
        shape, (window - 1, 0 if is_causal else window - 1), offset=0)
  elif is_causal:
    one_mask = splash.CausalMask(shape)
  else:
    one_mask = splash.FullMask(shape)
  block_q, block_kv = _splash_block(padded_q), _splash_block(padded_kv)
  blocks = splash.BlockSizes(
      block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
      block_q_dkv=block_q, block_kv_dkv=block_kv,
      block_kv_dkv_compute=block_kv, block_q_dq=block_q, block_kv_dq=block_kv)
  kernel = splash.make_splash_mha(
      splash.MultiHeadMask([one_mask] * num_heads), block_sizes=blocks,
      head_shards=1, q_seq_shards=1,
      interpret=jax.default_backend() == 'cpu')
  # Splash takes no scale: the queries are scaled in float32 first.
  q = (query.astype(jnp.float32) * scale).astype(query.dtype)
  heads_first = lambda x, length: jnp.transpose(_pad_length(x, length),
                                                (0, 2, 1, 3))
  q = heads_first(q, padded_q)
  k, v = heads_first(key, padded_kv), heads_first(value, padded_kv)
  ids = _segment_ids(mask, batch, q_len, kv_len, padded_q, padded_kv)
  if ids is None:
    out = jax.vmap(kernel)(q, k, v)
  else:
    out = jax.vmap(lambda q, k, v, q_ids, kv_ids: kernel(
        q, k, v, segment_ids=splash.SegmentIds(q_ids, kv_ids)))(q, k, v, *ids)
  out = jnp.transpose(out, (0, 2, 1, 3))[:, :q_len]
  if mask is None or isinstance(mask, core.SegmentMask):
    return out  # Every query sees a key (itself, under segments).
  return _zero_rows(out, rows_with_keys(_key_valid(mask, batch), q_len,
                                        is_causal=is_causal, window=window))


def _pallas_gpu_length(length: int) -> int:
  """The length padded for the Triton kernel, whose blocks are powers of
  two up to 128 dividing it."""
  if length <= 128:
    return max(16, 1 << (length - 1).bit_length())
  return _padded_length(length, 128)


def _pallas_gpu(query, key, value, mask, *, scale, is_causal, window):
  """The Pallas (Triton) flash attention; self-attention only."""
  del window  # Refused.
  batch, length, num_heads, _ = query.shape
  padded = _pallas_gpu_length(length)
  block = min(128, padded)
  blocks = pallas_gpu.BlockSizes(
      block_q=block, block_k=block, block_q_dkv=min(32, block),
      block_kv_dkv=min(32, block), block_q_dq=min(32, block),
      block_kv_dq=min(32, block))
  group = num_heads // key.shape[2]
  key, value = (jnp.repeat(_pad_length(x, padded), group, axis=2)
                for x in (key, value))
  ids = _segment_ids(mask, batch, length, length, padded, padded)
  if ids is not None:  # One array for queries and keys: the keys'.
    ids = ids[1]
  out = pallas_gpu.mha(_pad_length(query, padded), key, value, ids,
                       sm_scale=scale, causal=is_causal, block_sizes=blocks,
                       interpret=jax.default_backend() == 'cpu')
  return out[:, :length]


def _batch_axes() -> tuple[str, ...]:
  """The axes of the mesh in context, of size > 1 and not already manual,
  that the logical axis 'batch' maps to (under `nn.logical_axis_rules`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  spec = nn.logical_to_mesh_axes(('batch',))[0]
  names = (spec,) if isinstance(spec, str) else tuple(spec or ())
  return tuple(name for name in names if mesh.shape.get(name, 1) > 1
               and name not in mesh.manual_axes)


def _over_batch_shards(fn, query, key, value, mask):
  """fn(query, key, value, mask), each device taking its examples of the
  batch where a mesh splits it (a Pallas call cannot be split by XLA)."""
  axes = _batch_axes()
  if not axes or query.shape[0] % math.prod(
      jax.sharding.get_abstract_mesh().shape[name] for name in axes):
    return fn(query, key, value, mask)
  rows = jax.sharding.PartitionSpec(axes)
  mask_spec = None
  if isinstance(mask, core.SegmentMask):
    mask_spec = jax.tree.map(lambda _: rows, mask)
  elif mask is not None:
    mask_spec = rows if mask.shape[0] != 1 else jax.sharding.PartitionSpec()
  return jax.shard_map(fn, in_specs=(rows, rows, rows, mask_spec),
                       out_specs=rows, axis_names=set(axes), check_vma=False)(
                           query, key, value, mask)
