"""Block-sparse self-attention: `local`, `strided`, `fixed` and `bigbird`.

Each pattern is said twice, for two kinds of implementation. As a
patterns.Pattern, the pairs it allows as a predicate on positions, which
the fused kernels read (model/attention/kernels/fused.py: splash
attention's block masks on a TPU, the project's general kernel,
flex_gpu.py, on a GPU).
And for the JAX code ('xla'), as a list of *parts*. A part splits the
padded query positions into groups that read one shared, gathered list
of keys, and says with a predicate which (query, key) pairs among those it
allows. The parts of a pattern never allow the same pair twice, so joining
all parts' logits per query under one softmax gives exactly dense
attention under the pattern's mask, while computing only the gathered
pairs: O(T * keys per query) work and memory, never O(T^2). Masks and
biases are read at the gathered pairs only.
"""

from collections.abc import Callable
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from model.attention import core
from model.attention.core import patterns
from model.attention.kernels import fused
from model.attention.variants import chunked

Array = jax.Array
# allowed(query_positions, key_positions) -> bool, broadcasting.
Predicate = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Part:
  """Queries `query_index[g]` read keys `key_index[g]` where `allowed`.

  query_index: [G, gq], every padded query position exactly once.
  key_index: [G, gk] key positions; -1 marks an empty slot.
  """

  query_index: np.ndarray
  key_index: np.ndarray
  allowed: Predicate


def blocks(length: int, size: int) -> np.ndarray:
  """Positions 0..length-1 as [length // size, size]."""
  return np.arange(length).reshape(-1, size)


def neighbour_blocks(num_blocks: int, size: int, offsets) -> np.ndarray:
  """For each block i the positions of blocks i + offset, -1 past the ends:
  [num_blocks, len(offsets) * size]."""
  index = np.arange(num_blocks)[:, None] + np.asarray(offsets)[None, :]
  inside = (index >= 0) & (index < num_blocks)
  positions = index[:, :, None] * size + np.arange(size)
  return np.where(inside[:, :, None], positions, -1).reshape(num_blocks, -1)


def attend_parts(query: Array, key: Array, value: Array,
                 bias: Array | None, mask: Array | None, *, scale: float,
                 is_causal: bool, parts: list[Part],
                 sinks: Array | None = None) -> Array:
  """Exact attention over the union of `parts`, [B, T, N, H], with
  `sinks` (core.sink_softmax).

  The parts may cover a padded length; pairs with a key past the true
  length T are excluded, and outputs past it are dropped.
  """
  batch, length, num_heads, head_dim = query.shape
  num_kv_heads = key.shape[2]
  group = num_heads // num_kv_heads
  padded = parts[0].query_index.size
  query, key, value = (jnp.pad(x, ((0, 0), (0, padded - length), (0, 0),
                                   (0, 0))) for x in (query, key, value))
  logits_parts = []
  for part in parts:
    q_pos = part.query_index[:, :, None]
    k_pos = part.key_index[:, None, :]
    valid = (k_pos >= 0) & (k_pos < length) & part.allowed(q_pos, k_pos)
    if is_causal:
      valid = valid & (k_pos <= q_pos)
    q_g = jnp.take(query, part.query_index, axis=1)  # [B, G, gq, N, H]
    k_g = jnp.take(key, part.key_index.clip(0), axis=1)  # [B, G, gk, K, H]
    q_g = q_g.reshape(*q_g.shape[:3], num_kv_heads, group, head_dim)
    logits = jnp.einsum('bgqkjh,bgckh->bkjgqc', q_g, k_g,
                        preferred_element_type=jnp.float32) * scale
    logits = logits.reshape(batch, num_heads, *logits.shape[3:])
    inside = (q_pos.clip(0, length - 1), k_pos.clip(0, length - 1))
    logits = core.scored(logits, bias, *inside)
    valid = jnp.asarray(valid)
    if mask is not None:
      valid = valid & core.mask_at(mask, *inside)
    logits = jnp.where(valid, logits, -jnp.inf)
    # Per-query layout [B, N, T, gk], so that all parts share one softmax.
    logits = logits.reshape(batch, num_heads, padded, -1)
    logits_parts.append(jnp.take(
        logits, np.argsort(part.query_index.ravel()), axis=2))
  weights = core.sink_softmax(jnp.concatenate(logits_parts, axis=-1), sinks)
  out = 0.0
  start = 0
  for part in parts:
    width = part.key_index.shape[1]
    w = jnp.take(weights[..., start:start + width],
                 part.query_index.ravel(), axis=2)
    start += width
    w = w.reshape(batch, num_kv_heads, group, *part.query_index.shape, width)
    v_g = jnp.take(value, part.key_index.clip(0), axis=1)  # [B, G, gk, K, H]
    out_g = jnp.einsum('bkjgqc,bgckh->bgqkjh', w.astype(value.dtype), v_g,
                       preferred_element_type=jnp.float32)
    out_g = out_g.reshape(batch, padded, num_heads, head_dim)
    out = out + jnp.take(out_g, np.argsort(part.query_index.ravel()), axis=1)
  return out[:, :length].astype(query.dtype)


def _check_self_attention(name: str, query: Array, key: Array, value: Array,
                          bias, mask, sinks) -> None:
  core.check_inputs(query, key, value, bias, mask)
  core.check_sinks(sinks, query.shape[2])
  if query.shape[1] != key.shape[1]:
    raise ValueError(
        f'{name} attention is self-attention: query length {query.shape[1]} '
        f'must equal key length {key.shape[1]}.')


def _padded(length: int, block: int) -> int:
  return -(-length // block) * block


def _scale(query: Array, scale: float | None) -> float:
  return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale


def _positive(**options):
  for name, value in options.items():
    if value < 1:
      raise ValueError(f'{name}={value} must be positive.')


def _fused(kernel: str, query: Array, key: Array, value: Array, bias, mask, *,
           scale: float, is_causal: bool, window: int | None = None,
           pattern: patterns.Pattern | None = None,
           sinks: Array | None = None) -> Array | None:
  """The output of the fused kernel that `kernel` names, or that 'auto'
  picks (model/attention/kernels/fused.py); None where the JAX code
  computes it."""
  kernel = fused.choose(kernel, fused.case_of(
      query, key, bias, mask, is_causal=is_causal, window=window,
      pattern=pattern, sinks=sinks))
  if kernel == 'xla':
    return None
  return fused.run(kernel, query, key, value, bias, mask, scale=scale,
                   is_causal=is_causal, window=window, pattern=pattern,
                   sinks=sinks)


def _band(padded: int, block: int, window: int, is_causal: bool) -> Part:
  """Pairs with |i - j| < window, on blocks of `block` >= window (or of the
  whole sequence) positions, each reading itself and its neighbours (the
  earlier one only, when causal)."""
  offsets = (-1, 0) if is_causal else (-1, 0, 1)
  return Part(blocks(padded, block),
              neighbour_blocks(padded // block, block, offsets),
              lambda q, k: np.abs(q - k) < window)


# local's window when its option is not set.
LOCAL_WINDOW = 128


def local_pattern(window: int = LOCAL_WINDOW, **unused_options
                  ) -> Callable[[Array, Array], Array]:
  """local_attention's pattern by positions: a key fewer than `window`
  positions from its query (what decoding from a cache reads)."""
  del unused_options  # The kernel reads no cache.
  return lambda q_positions, kv_positions: (
      jnp.abs(q_positions - kv_positions) < window)


def local_attention(query: Array, key: Array, value: Array,
                    bias: Array | None = None, mask: Array | None = None, *,
                    scale: float | None = None, is_causal: bool = False,
                    window: int = LOCAL_WINDOW, kernel: str = 'auto',
                    sinks: Array | None = None) -> Array:
  """Sliding-window attention: query i sees keys j with |i - j| < window
  (causal: 0 <= i - j < window). The JAX code ('xla') computes blocks of
  `window` positions, each reading its neighbour blocks: O(T * window); a
  window as long as the row is chunked attention, and computed by it (its
  kernel too);
  `kernel` picks it or a fused kernel as for `chunked`
  (model/attention/kernels/fused.py); `sinks` as dense's."""
  _check_self_attention('local', query, key, value, bias, mask, sinks)
  _positive(window=window)
  if window >= query.shape[1]:  # Every key of the row: chunked's function.
    return chunked.chunked_attention(query, key, value, bias, mask,
                                     scale=scale, is_causal=is_causal,
                                     kernel=kernel, sinks=sinks)
  out = _fused(kernel, query, key, value, bias, mask,
               scale=_scale(query, scale), is_causal=is_causal, window=window,
               sinks=sinks)
  if out is not None:
    return out
  block = min(window, query.shape[1])
  part = _band(_padded(query.shape[1], block), block, window, is_causal)
  return attend_parts(query, key, value, bias, mask, scale=_scale(query, scale),
                      is_causal=is_causal, parts=[part], sinks=sinks)


def strided_attention(query: Array, key: Array, value: Array,
                      bias: Array | None = None, mask: Array | None = None, *,
                      scale: float | None = None, is_causal: bool = False,
                      stride: int = 128, kernel: str = 'auto',
                      sinks: Array | None = None) -> Array:
  """The strided pattern of the Sparse Transformer (Child et al. 2019), both
  halves merged: query i sees keys j with |i - j| < stride, and keys j with
  i - j a multiple of stride. The JAX code ('xla'): local blocks plus the
  columns of the [T / stride, stride] grid, O(T * (stride + T / stride));
  `kernel` picks it or a fused kernel as for `chunked`; `sinks` as
  dense's."""
  _check_self_attention('strided', query, key, value, bias, mask, sinks)
  _positive(stride=stride)
  stride = min(stride, query.shape[1])
  out = _fused(kernel, query, key, value, bias, mask,
               scale=_scale(query, scale), is_causal=is_causal,
               pattern=patterns.Strided(stride), sinks=sinks)
  if out is not None:
    return out
  padded = _padded(query.shape[1], stride)
  local = _band(padded, stride, stride, is_causal)
  columns = blocks(padded, stride).T  # Positions congruent mod stride.
  strides = Part(columns, columns, lambda q, k: np.abs(q - k) >= stride)
  return attend_parts(query, key, value, bias, mask, scale=_scale(query, scale),
                      is_causal=is_causal, parts=[local, strides],
                      sinks=sinks)


def fixed_attention(query: Array, key: Array, value: Array,
                    bias: Array | None = None, mask: Array | None = None, *,
                    scale: float | None = None, is_causal: bool = False,
                    block: int = 128, summary: int = 8,
                    kernel: str = 'auto', sinks: Array | None = None
                    ) -> Array:
  """The fixed pattern of the Sparse Transformer (Child et al. 2019), both
  halves merged: query i sees the keys of its own block of `block`
  positions, and the last `summary` positions of every block. The JAX
  code: O(T * (block + T * summary / block)); `kernel` and `sinks` as
  for `strided`."""
  _check_self_attention('fixed', query, key, value, bias, mask, sinks)
  _positive(block=block, summary=summary)
  if summary > block:
    raise ValueError(f'summary={summary} must not exceed block={block}.')
  out = _fused(kernel, query, key, value, bias, mask,
               scale=_scale(query, scale), is_causal=is_causal,
               pattern=patterns.Fixed(block, summary), sinks=sinks)
  if out is not None:
    return out
  length = query.shape[1]
  padded = _padded(length, block)
  own = Part(blocks(padded, block), blocks(padded, block),
             lambda q, k: np.ones(np.broadcast_shapes(q.shape, k.shape),
                                  bool))
  summaries = np.arange(padded)[np.arange(padded) % block >= block - summary]
  columns = Part(np.arange(padded)[None], summaries[None],
                 lambda q, k: q // block != k // block)
  return attend_parts(query, key, value, bias, mask, scale=_scale(query, scale),
                      is_causal=is_causal, parts=[own, columns],
                      sinks=sinks)


def bigbird_random_blocks(num_blocks: int, num_global_blocks: int,
                          num_random_blocks: int, seed: int) -> np.ndarray:
  """[num_blocks, num_random_blocks] block ids each query block attends at
  random, -1 where too few remain: never a global block, never the block
  itself or its neighbours. The same seed gives the same pattern."""
  rng = np.random.default_rng(seed)
  chosen = np.full((num_blocks, num_random_blocks), -1)
  for i in range(num_blocks):
    candidates = [j for j in range(num_global_blocks, num_blocks)
                  if abs(j - i) > 1]
    picks = rng.permutation(candidates)[:num_random_blocks]
    chosen[i, :len(picks)] = picks
  return chosen


def bigbird_attention(query: Array, key: Array, value: Array,
                      bias: Array | None = None, mask: Array | None = None, *,
                      scale: float | None = None, is_causal: bool = False,
                      block: int = 64, num_global_blocks: int = 1,
                      num_random_blocks: int = 3, seed: int = 0,
                      kernel: str = 'auto', sinks: Array | None = None
                      ) -> Array:
  """BigBird (Zaheer et al. 2020) on blocks of `block` positions: each query
  block sees its own and neighbouring blocks, the first `num_global_blocks`
  blocks, and `num_random_blocks` random blocks (fixed by `seed`); the
  global blocks' queries see every key. The JAX code: O(T * block * (3 +
  global + random)) for the rest, O(global * block * T) for the global
  rows; `kernel` and `sinks` as for `strided`."""
  _check_self_attention('bigbird', query, key, value, bias, mask, sinks)
  _positive(block=block)
  if num_global_blocks < 0 or num_random_blocks < 0:
    raise ValueError('num_global_blocks and num_random_blocks must be >= 0.')
  length = query.shape[1]
  block = min(block, length)
  padded = _padded(length, block)
  num_blocks = padded // block
  scale = _scale(query, scale)
  num_global = min(num_global_blocks, num_blocks)
  random_blocks = bigbird_random_blocks(num_blocks, num_global,
                                        num_random_blocks, seed)
  pattern = patterns.BigBird(block, num_global,
                             tuple(map(tuple, random_blocks.tolist())))
  out = _fused(kernel, query, key, value, bias, mask, scale=scale,
               is_causal=is_causal, pattern=pattern, sinks=sinks)
  if out is not None:
    return out
  if num_global * block >= length:  # Every row is global: dense attention.
    return core.scaled_dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        sinks=sinks)
  not_global = lambda q, k: k // block >= num_global
  parts = [Part(blocks(padded, block),
                neighbour_blocks(num_blocks, block, (-1, 0, 1)), not_global)]
  if num_global:
    parts.append(Part(np.arange(padded)[None],
                      np.arange(num_global * block)[None],
                      lambda q, k: np.ones(np.broadcast_shapes(q.shape,
                                                               k.shape), bool)))
  if random_blocks.size:
    random_keys = np.where(random_blocks[:, :, None] >= 0,
                           random_blocks[:, :, None] * block
                           + np.arange(block), -1).reshape(num_blocks, -1)
    parts.append(Part(blocks(padded, block), random_keys, not_global))
  out = attend_parts(query, key, value, bias, mask, scale=scale,
                     is_causal=is_causal, parts=parts, sinks=sinks)
  # The global blocks' queries attend to every key: dense rows.
  rows = np.arange(min(num_global * block, length))
  row_mask = core.causal_mask(length, length)[rows][None, None] if (
      is_causal) else None
  if mask is not None:
    gathered = core.mask_at(mask, rows[:, None], np.arange(length)[None, :])
    row_mask = gathered if row_mask is None else row_mask & gathered
  # The rows are the first ones: a score function reads them as dense does.
  row_bias = bias
  if bias is not None and not isinstance(bias, core.PositionBias):
    row_bias = core.pairs(bias, rows[:, None], np.arange(length)[None, :])
  if rows.size:
    global_out = core.scaled_dot_product_attention(
        query[:, rows], key, value, row_bias, row_mask, scale=scale,
        sinks=sinks)
    out = out.at[:, rows].set(global_out)
  return out
