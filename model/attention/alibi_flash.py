"""Flash attention with ALiBi's bias computed inside the kernel (Press et
al. 2022): logits q.k * scale - slope_n |p_j - p_i| from each token's
position p, so no [T, S] bias is ever built. A Pallas kernel: Triton on a
GPU, interpreted on the CPU (alibi_flash_tpu.py is a TPU's). Forward and
backward (FlashAttention-2's recomputation from the saved log-sum-exp, Dao
2023), causal or not, grouped-query heads, and any mask that segment ids
can say: packed rows, key padding (keys of another id), or none.

Layout [B, T, N, H] as `dense`; queries and keys share one length T (self-
attention), padded to a multiple of the block. Each query block is a
program that loops over key blocks (up to the diagonal when causal); the
key/value gradients are a program per key block looping over query blocks,
per query head, summed over each key head's group afterwards.
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp
import numpy as np

Array = jax.Array
# A logit no softmax weight survives, finite so that a row of them stays
# finite; such weights are also zeroed where they are masked.
MASKED = -0.7 * float(np.finfo(np.float32).max)
# Ids of padded queries and keys: no real token and no each other.
_PAD_QUERY, _PAD_KEY = np.iinfo(np.int32).min, np.iinfo(np.int32).min + 1


def block_size(length: int) -> int:
  """The query and key block: 64, or a power of two >= 16 under it."""
  return min(64, max(16, 1 << (length - 1).bit_length()))


def biased_logits(s, q_pos, k_pos, q_ids, k_ids, q_index, k_index, *,
                  slope, is_causal):
  """(logits `s` [bq, bk] float32 less ALiBi's slope * |p_j - p_i|,
  masked where ids differ or, causal, j > i; the bool mask). Positions,
  ids and indices of queries [bq, 1] and of keys [1, bk]."""
  distance = jnp.abs((k_pos - q_pos).astype(jnp.float32))
  mask = q_ids == k_ids
  if is_causal:
    mask &= q_index >= k_index
  return jnp.where(mask, s - slope * distance, MASKED), mask


def _logits(q, k, q_pos, k_pos, q_ids, k_ids, q_index, k_index, *, slope,
            scale, is_causal):
  """`biased_logits` of a query block and a key block (rows of [bq] and
  [bk] positions, ids and indices)."""
  s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
  return biased_logits(s, q_pos[:, None], k_pos[None, :], q_ids[:, None],
                       k_ids[None, :], q_index[:, None], k_index[None, :],
                       slope=slope, is_causal=is_causal)


def softmax_start(shape_BqxH):
  """The online softmax's (accumulator, running max, running sum) before a
  query block's first key block."""
  rows = shape_BqxH[0]
  return (jnp.zeros(shape_BqxH, jnp.float32),
          jnp.full((rows,), MASKED, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def softmax_step(carry, s, mask, v):
  """The online softmax after one more key block: logits `s` [bq, bk]
  float32, masked to MASKED where `mask` is False; its values `v`."""
  acc, m, l = carry
  m_next = jnp.maximum(m, jnp.max(s, axis=1))
  p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
  correction = jnp.exp(m - m_next)
  acc = acc * correction[:, None] + jnp.dot(
      p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return acc, m_next, l * correction + jnp.sum(p, axis=1)


def softmax_finish(carry, o_ref, lse_ref):
  """Writes a query block's output and log-sum-exp. A query that saw no
  key (sum 0) comes out 0, as from dense."""
  acc, m, l = carry
  l = jnp.where(l == 0.0, 1.0, l)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def dq_step(dq, s, mask, lse, delta, do, k, v):
  """dq [bq, H] float32 (unscaled) after one more key block: FlashAttention-
  2's recomputation of the block's weights from the log-sum-exp `lse`."""
  p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
  dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
  ds = p * (dp - delta[:, None])
  return dq + jnp.dot(ds.astype(k.dtype), k,
                      preferred_element_type=jnp.float32)


def dkv_step(carry, s, mask, lse, delta, q, do, v):
  """(dk unscaled, dv) [bk, H] float32 after one more query block: its
  queries `q`, output gradients `do`, log-sum-exps and deltas."""
  dk, dv = carry
  p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
  dv = dv + jnp.dot(p.T.astype(do.dtype), do,
                    preferred_element_type=jnp.float32)
  dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
  ds = p * (dp - delta[:, None])
  dk = dk + jnp.dot(ds.T.astype(q.dtype), q,
                    preferred_element_type=jnp.float32)
  return dk, dv


def _key_blocks(query_block, num_blocks: int, is_causal: bool):
  """The key blocks a query block visits: [0, stop)."""
  return query_block + 1 if is_causal else num_blocks


def _forward_kernel(slope_ref, q_ref, k_ref, v_ref, q_pos_ref, k_pos_ref,
                    q_ids_ref, k_ids_ref, o_ref, lse_ref, *, scale,
                    is_causal, block):
  i = pl.program_id(0)
  q, q_pos, q_ids = q_ref[...], q_pos_ref[...], q_ids_ref[...]
  q_index = i * block + jnp.arange(block)
  slope = slope_ref[0]

  def visit(j, carry):
    keys = pl.ds(j * block, block)
    s, mask = _logits(q, k_ref[keys, :], q_pos, k_pos_ref[keys],
                      q_ids, k_ids_ref[keys], q_index,
                      j * block + jnp.arange(block), slope=slope,
                      scale=scale, is_causal=is_causal)
    return softmax_step(carry, s, mask, v_ref[keys, :])

  carry = lax.fori_loop(
      0, _key_blocks(i, k_ref.shape[0] // block, is_causal), visit,
      softmax_start(q.shape))
  softmax_finish(carry, o_ref, lse_ref)


def _dq_kernel(slope_ref, q_ref, k_ref, v_ref, q_pos_ref, k_pos_ref,
               q_ids_ref, k_ids_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               scale, is_causal, block):
  i = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_index = i * block + jnp.arange(block)

  def visit(j, dq):
    keys = pl.ds(j * block, block)
    k, v = k_ref[keys, :], v_ref[keys, :]
    s, mask = _logits(q, k, q_pos_ref[...], k_pos_ref[keys],
                      q_ids_ref[...], k_ids_ref[keys], q_index,
                      j * block + jnp.arange(block), slope=slope_ref[0],
                      scale=scale, is_causal=is_causal)
    return dq_step(dq, s, mask, lse, delta, do, k, v)

  dq = lax.fori_loop(0, _key_blocks(i, k_ref.shape[0] // block, is_causal),
                     visit, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(slope_ref, q_ref, k_ref, v_ref, q_pos_ref, k_pos_ref,
                q_ids_ref, k_ids_ref, do_ref, lse_ref, delta_ref, dk_ref,
                dv_ref, *, scale, is_causal, block):
  j = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]
  k_pos, k_ids = k_pos_ref[...], k_ids_ref[...]
  k_index = j * block + jnp.arange(block)

  def visit(i, carry):
    queries = pl.ds(i * block, block)
    q = q_ref[queries, :]
    s, mask = _logits(q, k, q_pos_ref[queries], k_pos, q_ids_ref[queries],
                      k_ids, i * block + jnp.arange(block), k_index,
                      slope=slope_ref[0], scale=scale, is_causal=is_causal)
    return dkv_step(carry, s, mask, lse_ref[queries], delta_ref[queries], q,
                    do_ref[queries, :], v)

  first = j if is_causal else 0
  dk, dv = lax.fori_loop(first, q_ref.shape[0] // block, visit,
                         (jnp.zeros(k.shape, jnp.float32),
                          jnp.zeros(v.shape, jnp.float32)))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(block: int, length: int, group: int, head_dim: int):
  """BlockSpecs over the grid (query block i, example b, query head n) of
  the inputs every kernel takes: the head's slope, its query block, its
  key/value head's whole rows, the query block's positions, the rows'
  positions, the query block's ids, the rows' ids."""
  query_block = pl.BlockSpec((None, block, None, head_dim),
                             lambda i, b, n: (b, i, n, 0))
  key_rows = pl.BlockSpec((None, length, None, head_dim),
                          lambda i, b, n: (b, 0, n // group, 0))
  block_of_row = pl.BlockSpec((None, block), lambda i, b, n: (b, i))
  rows = pl.BlockSpec((None, length), lambda i, b, n: (b, 0))
  return [pl.BlockSpec((1,), lambda i, b, n: (n,)), query_block, key_rows,
          key_rows, block_of_row, rows, block_of_row, rows]


def per_query_block(block: int) -> pl.BlockSpec:
  """A query block's log-sum-exp or delta, of [B, N, T] float32."""
  return pl.BlockSpec((None, None, block), lambda i, b, n: (b, n, i))


def call_kernel(kernel, inputs, in_specs, out_specs, out_shape, grid, *,
                name, head_dim: int, **params):
  """`kernel` as a pallas_call: Triton on a GPU, interpreted on the CPU."""
  return pl.pallas_call(
      functools.partial(kernel, **params), grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape, name=name,
      compiler_params=plgpu.CompilerParams(
          num_warps=4 if head_dim <= 64 else 8, num_stages=2),
      interpret=jax.default_backend() == 'cpu')(*inputs)


def _forward(inputs, *, scale, is_causal):
  q, k = inputs[1], inputs[2]
  batch, length, num_heads, head_dim = q.shape
  block = block_size(length)
  group = num_heads // k.shape[2]
  specs = _specs(block, length, group, head_dim)
  return call_kernel(
      _forward_kernel, inputs, specs, [specs[1], per_query_block(block)],
      [jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((batch, num_heads, length), jnp.float32)],
      (length // block, batch, num_heads), name='alibi_flash_forward',
      head_dim=head_dim, scale=scale, is_causal=is_causal, block=block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _attention(slopes, q, k, v, q_pos, k_pos, ids, scale, is_causal):
  return _forward((slopes, q, k, v, q_pos, k_pos, ids[0], ids[1]),
                  scale=scale, is_causal=is_causal)[0]


def _attention_forward(slopes, q, k, v, q_pos, k_pos, ids, scale, is_causal):
  out, lse = _forward((slopes, q, k, v, q_pos, k_pos, ids[0], ids[1]),
                      scale=scale, is_causal=is_causal)
  return out, (slopes, q, k, v, q_pos, k_pos, ids, out, lse)


def _attention_backward(scale, is_causal, residuals, d_out):
  slopes, q, k, v, q_pos, k_pos, ids, out, lse = residuals
  batch, length, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  block = block_size(length)
  group = num_heads // num_kv_heads
  delta = jnp.einsum('btnh,btnh->bnt', out.astype(jnp.float32),
                     d_out.astype(jnp.float32))
  inputs = (slopes, q, k, v, q_pos, k_pos, ids[0], ids[1], d_out, lse, delta)
  specs = _specs(block, length, group, head_dim)
  rows_of_head = pl.BlockSpec((None, None, length), lambda i, b, n: (b, n, 0))
  grid = (length // block, batch, num_heads)
  params = dict(head_dim=head_dim, scale=scale, is_causal=is_causal,
                block=block)
  dq = call_kernel(
      _dq_kernel, inputs,
      specs + [specs[1], per_query_block(block), per_query_block(block)],
      specs[1], jax.ShapeDtypeStruct(q.shape, q.dtype), grid,
      name='alibi_flash_dq', **params)
  # Per key block: the query head's whole rows, the key head's block.
  whole_rows = pl.BlockSpec((None, length, None, head_dim),
                            lambda j, b, n: (b, 0, n, 0))
  key_block = pl.BlockSpec((None, block, None, head_dim),
                           lambda j, b, n: (b, j, n // group, 0))
  positions_block = pl.BlockSpec((None, block), lambda j, b, n: (b, j))
  rows = pl.BlockSpec((None, length), lambda j, b, n: (b, 0))
  per_query_head = pl.BlockSpec((None, block, None, head_dim),
                                lambda j, b, n: (b, j, n, 0))
  dk, dv = call_kernel(
      _dkv_kernel, inputs,
      [specs[0], whole_rows, key_block, key_block, rows, positions_block,
       rows, positions_block, whole_rows, rows_of_head, rows_of_head],
      [per_query_head, per_query_head],
      [jax.ShapeDtypeStruct(q.shape, k.dtype)] * 2, grid,
      name='alibi_flash_dkv', **params)
  # Each key/value head's gradient: the sum over the query heads it serves.
  dk, dv = (x.reshape(batch, length, num_kv_heads, group, head_dim).sum(
      3, dtype=jnp.float32).astype(k.dtype) for x in (dk, dv))
  return None, dq, dk, dv, None, None, None


_attention.defvjp(_attention_forward, _attention_backward)


def pad_length(x: Array, length: int, value=0) -> Array:
  """[B, T, ...] padded along T to `length` with `value`."""
  return jnp.pad(x, [(0, 0), (0, length - x.shape[1])]
                 + [(0, 0)] * (x.ndim - 2), constant_values=value)


def padded(query: Array, key: Array, value: Array, q_positions_BxT: Array,
           kv_positions_BxT: Array, q_ids_BxT: Array | None,
           kv_ids_BxT: Array | None, block: int) -> tuple[Array, ...]:
  """The inputs padded along T to a multiple of `block`: (q, k, v, query
  positions, key positions, query ids, key ids), positions and ids [B, T]
  int32, the ids as `padded_ids` gives them."""
  batch, length = query.shape[:2]
  padded_length = -(-length // block) * block
  positions = [
      pad_length(jnp.broadcast_to(p, (batch, length)).astype(jnp.int32),
                 padded_length) for p in (q_positions_BxT, kv_positions_BxT)]
  return (pad_length(query, padded_length), pad_length(key, padded_length),
          pad_length(value, padded_length), *positions,
          *padded_ids(q_ids_BxT, kv_ids_BxT, batch, length, padded_length))


def padded_ids(q_ids_BxT: Array | None, kv_ids_BxT: Array | None,
               batch: int, length: int, padded_length: int
               ) -> tuple[Array, Array]:
  """(query ids, key ids) [B, padded_length] int32: one id for all where
  neither is given, the queries' for the keys where only they are (as
  SegmentMask: self-attention), and ids no token has for the padded
  queries and keys. ValueError for key ids alone, which compare to no
  query's."""
  if q_ids_BxT is None:
    if kv_ids_BxT is not None:
      raise ValueError(
          'kv_ids_BxT without q_ids_BxT: key ids mean nothing without the '
          "queries' to compare to; pass q_ids_BxT too (for key padding, "
          'zeros, and key ids 0 where a key is real).')
    q_ids_BxT = jnp.zeros((batch, length), jnp.int32)
  if kv_ids_BxT is None:
    kv_ids_BxT = q_ids_BxT
  return (pad_length(q_ids_BxT.astype(jnp.int32), padded_length, _PAD_QUERY),
          pad_length(kv_ids_BxT.astype(jnp.int32), padded_length, _PAD_KEY))


def attention(query: Array, key: Array, value: Array, q_positions_BxT: Array,
              kv_positions_BxT: Array, slopes_N: Array, *, scale: float,
              is_causal: bool, q_ids_BxT: Array | None = None,
              kv_ids_BxT: Array | None = None) -> Array:
  """softmax(q.k * scale - slope_n |p_j - p_i|) v, [B, T, N, H], where
  query i and key j have equal ids (default: all do; the keys' default to
  the queries'; key ids alone are refused) and, when causal, j <= i.
  Positions and ids [B, T] int; slopes [N] float32 (constants: no gradient
  flows to them or to the positions)."""
  q, k, v, q_pos, kv_pos, q_ids, kv_ids = padded(
      query, key, value, q_positions_BxT, kv_positions_BxT, q_ids_BxT,
      kv_ids_BxT, block_size(query.shape[1]))
  out = _attention(slopes_N.astype(jnp.float32), q, k, v, q_pos, kv_pos,
                   (q_ids, kv_ids), scale, is_causal)
  return out[:, :query.shape[1]]
