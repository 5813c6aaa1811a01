"""ALiBi's flash attention for TPUs: the computation of alibi_flash.py as a
Pallas TPU (Mosaic) kernel, interpreted on the CPU.

A TPU program owns one block of each operand at a time, so the loop over
the other side's blocks is the grid's last axis ('arbitrary': in order),
with the softmax statistics and the accumulators in VMEM scratch across
it. Heads lead ([B, N, T, H]) so that a block's last two dims are (rows,
head dim); query positions and ids come as columns [B, T, 1], key ones as
rows [B, 1, T], so that a block of logits is their broadcast. Blocks are
128 (a TPU's lanes); causal programs skip the blocks above the diagonal
and fetch no operand for them.
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from model.attention import alibi_flash

Array = jax.Array
BLOCK = 128
# Contracting the last dims (a @ b.T), and the first (a.T @ b).
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _dot(a, b, dims):
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _logits(slope, q, k, q_pos_ref, k_pos_ref, q_ids_ref, k_ids_ref,
            query_block, key_block, *, scale, is_causal):
  """The biased, masked logits [BLOCK, BLOCK] of a query block against a
  key block (alibi_flash.biased_logits)."""
  q_index = query_block * BLOCK + lax.broadcasted_iota(
      jnp.int32, (BLOCK, 1), 0)
  k_index = key_block * BLOCK + lax.broadcasted_iota(
      jnp.int32, (1, BLOCK), 1)
  return alibi_flash.biased_logits(
      _dot(q, k, _NT) * scale, q_pos_ref[...], k_pos_ref[...],
      q_ids_ref[...], k_ids_ref[...], q_index, k_index,
      slope=slope, is_causal=is_causal)


def _program(slopes_ref):
  """(this head's slope, grid positions 2 and 3), read where the kernel
  starts: the interpreter reads program ids outside `pl.when` only."""
  return slopes_ref[pl.program_id(1)], pl.program_id(2), pl.program_id(3)


def _when_visible(is_causal: bool, query_block, key_block):
  """Runs the decorated body where the key block is not above the
  diagonal (always when not causal)."""
  def decorate(body):
    if is_causal:
      pl.when(key_block <= query_block)(body)
    else:
      body()
  return decorate


def _forward_kernel(slopes_ref, q_ref, k_ref, v_ref, q_pos_ref, k_pos_ref,
                    q_ids_ref, k_ids_ref, o_ref, lse_ref, m_scratch,
                    l_scratch, acc_scratch, *, scale, is_causal):
  slope, i, j = _program(slopes_ref)

  @pl.when(j == 0)
  def _():
    m_scratch[...] = jnp.full(m_scratch.shape, alibi_flash.MASKED,
                              jnp.float32)
    l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
    acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

  @_when_visible(is_causal, i, j)
  def _():
    s, mask = _logits(slope, q_ref[...], k_ref[...], q_pos_ref,
                      k_pos_ref, q_ids_ref, k_ids_ref, i, j, scale=scale,
                      is_causal=is_causal)
    m = m_scratch[...]
    m_next = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
    correction = jnp.exp(m - m_next)
    l_scratch[...] = l_scratch[...] * correction + jnp.sum(
        p, axis=1, keepdims=True)
    v = v_ref[...]
    acc_scratch[...] = acc_scratch[...] * correction + _dot(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())))
    m_scratch[...] = m_next

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    # A query that sees no key (l = 0) comes out 0, as from dense.
    l = jnp.where(l_scratch[...] == 0.0, 1.0, l_scratch[...])
    o_ref[...] = (acc_scratch[...] / l).astype(o_ref.dtype)
    lse_ref[...] = m_scratch[...] + jnp.log(l)


def _dq_kernel(slopes_ref, q_ref, k_ref, v_ref, q_pos_ref, k_pos_ref,
               q_ids_ref, k_ids_ref, do_ref, lse_ref, delta_ref, dq_ref,
               dq_scratch, *, scale, is_causal):
  slope, i, j = _program(slopes_ref)

  @pl.when(j == 0)
  def _():
    dq_scratch[...] = jnp.zeros(dq_scratch.shape, jnp.float32)

  @_when_visible(is_causal, i, j)
  def _():
    k = k_ref[...]
    s, mask = _logits(slope, q_ref[...], k, q_pos_ref, k_pos_ref,
                      q_ids_ref, k_ids_ref, i, j, scale=scale,
                      is_causal=is_causal)
    p = jnp.where(mask, jnp.exp(s - lse_ref[...]), 0.0)
    ds = p * (_dot(do_ref[...], v_ref[...], _NT) - delta_ref[...])
    dq_scratch[...] += _dot(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())))

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    dq_ref[...] = (dq_scratch[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(slopes_ref, q_ref, k_ref, v_ref, q_pos_ref, k_pos_ref,
                q_ids_ref, k_ids_ref, do_ref, lse_ref, delta_ref, dk_ref,
                dv_ref, dk_scratch, dv_scratch, *, scale, is_causal):
  slope, j, i = _program(slopes_ref)

  @pl.when(i == 0)
  def _():
    dk_scratch[...] = jnp.zeros(dk_scratch.shape, jnp.float32)
    dv_scratch[...] = jnp.zeros(dv_scratch.shape, jnp.float32)

  @_when_visible(is_causal, i, j)
  def _():
    q, do = q_ref[...], do_ref[...]
    s, mask = _logits(slope, q, k_ref[...], q_pos_ref, k_pos_ref,
                      q_ids_ref, k_ids_ref, i, j, scale=scale,
                      is_causal=is_causal)
    p = jnp.where(mask, jnp.exp(s - lse_ref[...]), 0.0)
    dv_scratch[...] += _dot(p.astype(do.dtype), do, _TN)
    ds = p * (_dot(do, v_ref[...], _NT) - delta_ref[...])
    dk_scratch[...] += _dot(ds.astype(q.dtype), q, _TN)

  @pl.when(i == pl.num_programs(3) - 1)
  def _():
    dk_ref[...] = (dk_scratch[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


def _specs(head_dim: int, group: int, is_causal: bool, *, by_key: bool):
  """BlockSpecs of (slopes, q, k, v, query positions, key positions, query
  ids, key ids, d_out, lse, delta) over the grid (b, n, i, j) of a program
  per query block, or (b, n, j, i) per key block (`by_key`). Causal, the
  blocks above the diagonal fetch the diagonal's again (no new copy)."""
  def blocks(first, second):
    i, j = (second, first) if by_key else (first, second)
    if is_causal:
      i, j = (jnp.maximum(i, j), j) if by_key else (i, jnp.minimum(i, j))
    return i, j

  rows = lambda index: pl.BlockSpec(
      (None, None, BLOCK, head_dim), index)
  query = rows(lambda b, n, x, y: (b, n, blocks(x, y)[0], 0))
  # lax.div: `//` floors by way of `sign`, whose lowering asks for a TPU.
  key = rows(lambda b, n, x, y: (b, lax.div(n, group), blocks(x, y)[1], 0))
  column = pl.BlockSpec((None, BLOCK, 1),
                        lambda b, n, x, y: (b, blocks(x, y)[0], 0))
  row = pl.BlockSpec((None, 1, BLOCK),
                     lambda b, n, x, y: (b, 0, blocks(x, y)[1]))
  stat = pl.BlockSpec((None, None, BLOCK, 1),
                      lambda b, n, x, y: (b, n, blocks(x, y)[0], 0))
  return [pl.BlockSpec(memory_space=pltpu.SMEM), query, key, key, column,
          row, column, row, query, stat, stat]


def _call(kernel, inputs, in_specs, out_specs, out_shape, scratch, grid,
          **params):
  return pl.pallas_call(
      functools.partial(kernel, **params), grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for shape in scratch],
      compiler_params=pltpu.CompilerParams(dimension_semantics=(
          'parallel', 'parallel', 'parallel', 'arbitrary')),
      interpret=jax.default_backend() == 'cpu')(*inputs)


def _forward(inputs, *, scale, is_causal):
  q, k = inputs[1], inputs[2]
  batch, num_heads, length, head_dim = q.shape
  specs = _specs(head_dim, num_heads // k.shape[1], is_causal, by_key=False)
  return _call(
      _forward_kernel, inputs, specs[:8], [specs[1], specs[9]],
      [jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((batch, num_heads, length, 1), jnp.float32)],
      [(BLOCK, 1), (BLOCK, 1), (BLOCK, head_dim)],
      (batch, num_heads, length // BLOCK, length // BLOCK), scale=scale,
      is_causal=is_causal)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _attention(slopes, q, k, v, q_pos, k_pos, ids, scale, is_causal):
  return _forward((slopes, q, k, v, q_pos, k_pos, *ids), scale=scale,
                  is_causal=is_causal)[0]


def _attention_forward(slopes, q, k, v, q_pos, k_pos, ids, scale, is_causal):
  out, lse = _forward((slopes, q, k, v, q_pos, k_pos, *ids), scale=scale,
                      is_causal=is_causal)
  return out, (slopes, q, k, v, q_pos, k_pos, ids, out, lse)


def _attention_backward(scale, is_causal, residuals, d_out):
  slopes, q, k, v, q_pos, k_pos, ids, out, lse = residuals
  batch, num_heads, length, head_dim = q.shape
  num_kv_heads = k.shape[1]
  group = num_heads // num_kv_heads
  delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32),
                  axis=-1, keepdims=True)
  inputs = (slopes, q, k, v, q_pos, k_pos, *ids, d_out, lse, delta)
  blocks = length // BLOCK
  params = dict(scale=scale, is_causal=is_causal)
  by_query = _specs(head_dim, group, is_causal, by_key=False)
  dq = _call(_dq_kernel, inputs, by_query, by_query[1],
             jax.ShapeDtypeStruct(q.shape, q.dtype), [(BLOCK, head_dim)],
             (batch, num_heads, blocks, blocks), **params)
  by_key = _specs(head_dim, group, is_causal, by_key=True)
  # Per query head; each key/value head's is the sum over its group.
  per_query_head = pl.BlockSpec((None, None, BLOCK, head_dim),
                                lambda b, n, j, i: (b, n, j, 0))
  dk, dv = _call(_dkv_kernel, inputs, by_key, [per_query_head] * 2,
                 [jax.ShapeDtypeStruct(q.shape, k.dtype)] * 2,
                 [(BLOCK, head_dim)] * 2,
                 (batch, num_heads, blocks, blocks), **params)
  dk, dv = (x.reshape(batch, num_kv_heads, group, length, head_dim).sum(
      2, dtype=jnp.float32).astype(k.dtype) for x in (dk, dv))
  return None, dq, dk, dv, None, None, None


_attention.defvjp(_attention_forward, _attention_backward)


def attention(query: Array, key: Array, value: Array, q_positions_BxT: Array,
              kv_positions_BxT: Array, slopes_N: Array, *, scale: float,
              is_causal: bool, q_ids_BxT: Array | None = None,
              kv_ids_BxT: Array | None = None) -> Array:
  """alibi_flash.attention, on a TPU's kernel."""
  q, k, v, q_pos, kv_pos, q_ids, kv_ids = alibi_flash.padded(
      query, key, value, q_positions_BxT, kv_positions_BxT, q_ids_BxT,
      kv_ids_BxT, BLOCK)
  heads_first = lambda x: jnp.transpose(x, (0, 2, 1, 3))
  out = _attention(slopes_N.astype(jnp.float32), heads_first(q),
                   heads_first(k), heads_first(v), q_pos[:, :, None],
                   kv_pos[:, None, :], (q_ids[:, :, None], kv_ids[:, None, :]),
                   scale, is_causal)
  return heads_first(out)[:, :query.shape[1]]
