"""The general fused kernel (flex.py) on a TPU, as flex_gpu.py's but in
Mosaic (the CPU interprets it). Heads lead ([B, N, T, H]) and tiles are
128 (a TPU's lanes). A TPU program owns one block of each operand at a
time, so the loop over the other side's tiles is the grid's last axis
('arbitrary': in order), its t-th step fetching the tile its row of the
tile table lists (prefetched as scalars), with the online softmax in
VMEM scratch; the steps past the row's count repeat its last tile (no
new copy) and compute nothing. Without a pattern step t is tile t,
clamped to the diagonal when causal: no table. Query ids and per-token
entries come as columns [B, T, 1], key ones as rows [B, 1, T]; the
score's scalars and tables whole in SMEM, read as scalars per head. A
pattern of whole tiles (BigBird's) needs a block that is a multiple of
128. Under moba's routed pattern the tables hold a row per example, head
and tile, computed on the device (flex.routed_tables), and each query
tile's choices come in as a block beside it. Prefetched, those tables
fill SMEM with B * N * (T / 128)^2 int32 entries per device, 2 MiB at 8
examples of 16 heads at 8K tokens (not yet run on a TPU).
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np

from model.attention.kernels import flex

Array = jax.Array
BLOCK = 128
# Contracting the last dims (a @ b.T), the first (a.T @ b), and a @ b.
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


def _dot(a, b, dims):
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _other(plan, by_key: bool, b, n, x, t, table):
  """The other side's tile at step t of tile x's program (grid (b, n, x,
  t)): its row of the table (a routed pattern's: example b's and head
  n's), or without a pattern step t itself, which causal attention clamps
  to the diagonal (the steps past it fetch nothing new)."""
  if plan.routed:
    return table[b, n, x, t]
  if plan.pattern is not None:
    return table[x, t]
  if not plan.is_causal:
    return t
  return jnp.maximum(t, x) if by_key else jnp.minimum(t, x)


def _program(plan, table_ref, counts_ref, params_ref, by_key: bool):
  """(head, query tile i, key tile j, step t, whether the step visits a
  tile, the head's columns), read where the kernel starts: the
  interpreter reads program ids outside `pl.when` only."""
  example, head = pl.program_id(0), pl.program_id(1)
  own, t = pl.program_id(2), pl.program_id(3)
  other = _other(plan, by_key, example, head, own, t, table_ref)
  i, j = (other, own) if by_key else (own, other)
  params = tuple(params_ref[head, c]
                 for c in range(plan.scores.layout.width))
  if plan.routed:
    visits = t < counts_ref[example, head, own]
  elif plan.pattern is not None:
    visits = t < counts_ref[own]
  else:
    visits = (t >= own if by_key else t <= own) if plan.is_causal else True
  return head, i, j, t, visits, params


def _tile(plan, q, k, q_ids, k_ids, token_refs, params, i, j, head):
  """plan.masked of query tile i against key tile j; a routed pattern's
  choices are the last of `token_refs`."""
  tokens = {name: ref[...] for (name, _), ref in
            zip(plan.scores.layout.tokens, token_refs)}
  return plan.masked(
      _dot(q, k, _NT), q_ids, k_ids, tokens, params,
      i * BLOCK + lax.broadcasted_iota(jnp.int32, (BLOCK, 1), 0),
      j * BLOCK + lax.broadcasted_iota(jnp.int32, (1, BLOCK), 1), head,
      tuple(token_refs[-1][:, slot:slot + 1]
            for slot in range(token_refs[-1].shape[1])) if plan.routed
      else None)


def _forward_kernel(table_ref, counts_ref, q_ref, k_ref, v_ref, q_ids_ref,
                    k_ids_ref, params_ref, *refs, plan):
  token_refs = refs[:-5]
  o_ref, lse_ref, m_scratch, l_scratch, acc_scratch = refs[-5:]
  head, i, j, t, visits, params = _program(plan, table_ref, counts_ref,
                                           params_ref, False)

  @pl.when(t == 0)
  def _():
    m_scratch[...] = jnp.full(m_scratch.shape, flex.MASKED, jnp.float32)
    l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
    acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

  @pl.when(visits)
  def _():
    s, mask, _ = _tile(plan, q_ref[...], k_ref[...], q_ids_ref[...],
                       k_ids_ref[...], token_refs, params, i, j, head)
    m = m_scratch[...]
    m_next = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
    correction = jnp.exp(m - m_next)
    l_scratch[...] = l_scratch[...] * correction + jnp.sum(
        p, axis=1, keepdims=True)
    v = v_ref[...]
    acc_scratch[...] = acc_scratch[...] * correction + _dot(
        p.astype(v.dtype), v, _NN)
    m_scratch[...] = m_next

  @pl.when(t == pl.num_programs(3) - 1)
  def _():
    # A query that saw no key (l = 0) comes out 0, as from dense.
    l = jnp.where(l_scratch[...] == 0.0, 1.0, l_scratch[...])
    o_ref[...] = (acc_scratch[...] / l).astype(o_ref.dtype)
    lse_ref[...] = m_scratch[...] + jnp.log(l)


def _dq_kernel(table_ref, counts_ref, q_ref, k_ref, v_ref, q_ids_ref,
               k_ids_ref, params_ref, *refs, plan):
  token_refs = refs[:-7]
  do_ref, lse_ref, delta_ref, dq_ref, d_params_ref = refs[-7:-2]
  dq_scratch, d_params_scratch = refs[-2:]
  head, i, j, t, visits, params = _program(plan, table_ref, counts_ref,
                                           params_ref, False)

  @pl.when(t == 0)
  def _():
    dq_scratch[...] = jnp.zeros(dq_scratch.shape, jnp.float32)
    d_params_scratch[...] = jnp.zeros(d_params_scratch.shape, jnp.float32)

  @pl.when(visits)
  def _():
    k = k_ref[...]
    s, mask, pull_back = _tile(plan, q_ref[...], k, q_ids_ref[...],
                               k_ids_ref[...], token_refs, params, i, j,
                               head)
    _, d_logits = flex.d_logits(s, mask, lse_ref[...], delta_ref[...],
                                _dot(do_ref[...], v_ref[...], _NT))
    ds, d_columns = pull_back(d_logits)
    dq_scratch[...] += _dot(ds.astype(k.dtype), k, _NN)
    # Each column's scalar gradient into its lane of the row.
    columns = lax.broadcasted_iota(jnp.int32, d_params_scratch.shape, 1)
    d_params = d_params_scratch[...]
    for column, d in enumerate(d_columns):
      d_params = d_params + jnp.where(columns == column, d, 0.0)
    d_params_scratch[...] = d_params

  @pl.when(t == pl.num_programs(3) - 1)
  def _():
    dq_ref[...] = (dq_scratch[...] * plan.scale).astype(dq_ref.dtype)
    d_params_ref[...] = d_params_scratch[...]


def _dkv_kernel(table_ref, counts_ref, q_ref, k_ref, v_ref, q_ids_ref,
                k_ids_ref, params_ref, *refs, plan):
  token_refs = refs[:-7]
  do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_scratch, dv_scratch = (
      refs[-7:])
  head, i, j, t, visits, params = _program(plan, table_ref, counts_ref,
                                           params_ref, True)

  @pl.when(t == 0)
  def _():
    dk_scratch[...] = jnp.zeros(dk_scratch.shape, jnp.float32)
    dv_scratch[...] = jnp.zeros(dv_scratch.shape, jnp.float32)

  @pl.when(visits)
  def _():
    q, do = q_ref[...], do_ref[...]
    s, mask, pull_back = _tile(plan, q, k_ref[...], q_ids_ref[...],
                               k_ids_ref[...], token_refs, params, i, j,
                               head)
    p, d_logits = flex.d_logits(s, mask, lse_ref[...], delta_ref[...],
                                _dot(do, v_ref[...], _NT))
    ds, _ = pull_back(d_logits)
    dv_scratch[...] += _dot(p.astype(do.dtype), do, _TN)
    dk_scratch[...] += _dot(ds.astype(q.dtype), q, _TN)

  @pl.when(t == pl.num_programs(3) - 1)
  def _():
    dk_ref[...] = (dk_scratch[...] * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


def _specs(plan: flex.Plan, head_dim: int, group: int, by_key: bool,
           slots: int = 0):
  """BlockSpecs of (q, k, v, query ids, key ids, the columns, the
  per-token entries, a routed pattern's choices, d_out, lse, delta) over
  the grid (b, n, x, t) with the tables prefetched: x the program's query
  tile and `_other` its key tile, or x the key tile and `_other` its
  query tile (`by_key`)."""
  def tiles(b, n, x, t, table):
    other = _other(plan, by_key, b, n, x, t, table)
    return (other, x) if by_key else (x, other)

  def spec(shape, index):
    return pl.BlockSpec(shape, lambda b, n, x, t, table, counts: index(
        b, n, *tiles(b, n, x, t, table)))

  rows = (None, None, BLOCK, head_dim)
  query = spec(rows, lambda b, n, i, j: (b, n, i, 0))
  # lax.div: `//` floors by way of `sign`, whose lowering asks for a TPU;
  # an int32 divisor, as the head's id is, whether or not x64 is on.
  key = spec(rows, lambda b, n, i, j: (b, lax.div(n, np.int32(group)), j,
                                       0))
  column = spec((None, BLOCK, 1), lambda b, n, i, j: (b, i, 0))
  row = spec((None, 1, BLOCK), lambda b, n, i, j: (b, 0, j))
  stat = spec((None, None, BLOCK, 1), lambda b, n, i, j: (b, n, i, 0))
  routing = [spec((None, None, BLOCK, slots),
                  lambda b, n, i, j: (b, n, i, 0))] if plan.routed else []
  return [query, key, key, column, row,
          pl.BlockSpec(memory_space=pltpu.SMEM)] + [
              column if role == 'query' else row
              for _, role in plan.scores.layout.tokens] + routing + [
                  query, stat, stat]


def _call(kernel, tables, inputs, in_specs, out_specs, out_shape, scratch,
          plan):
  """`kernel` as a pallas_call over (b, n, x, t), the tables (a row and a
  count per tile x) prefetched: Mosaic on a TPU, interpreted on the CPU."""
  table, counts = tables
  batch, num_heads, length = inputs[0].shape[:3]
  grid = (batch, num_heads, length // BLOCK, table.shape[-1])
  return pl.pallas_call(
      functools.partial(kernel, plan=plan),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=grid, in_specs=in_specs,
          out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM(shape, jnp.float32)
                          for shape in scratch]),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=(
          'parallel', 'parallel', 'parallel', 'arbitrary')),
      interpret=jax.default_backend() == 'cpu')(
          jnp.asarray(table), jnp.asarray(counts), *inputs)


def _tables(plan, length: int, routing):
  """The tile tables the grid steps over (plan.tables, as long as their
  longest row); without a pattern a row of every tile, which `_other`
  computes, so that no table of (T / 128)^2 entries fills the SMEM."""
  if plan.pattern is None:
    every = np.zeros((1, length // BLOCK), np.int32)
    return every, np.zeros(1, np.int32), every, np.zeros(1, np.int32)
  return plan.tables(length, power_of_two=False, routing=routing)


def _slots(routing) -> int:
  return 0 if routing is None else routing.shape[-1]


def _forward(plan, q, k, v, ids, routing, tokens, params):
  batch, num_heads, length, head_dim = q.shape
  specs = _specs(plan, head_dim, num_heads // k.shape[1], False,
                 _slots(routing))
  inputs = (q, k, v, *ids, params, *tokens, *flex.routed_inputs(routing))
  return _call(
      _forward_kernel, _tables(plan, length, routing)[:2], inputs,
      specs[:len(inputs)], [specs[0], specs[-1]],
      [jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((batch, num_heads, length, 1), jnp.float32)],
      [(BLOCK, 1), (BLOCK, 1), (BLOCK, head_dim)], plan)


def _backward(plan, residuals, d_out):
  q, k, v, ids, routing, tokens, params, out, lse = residuals
  batch, num_heads, length, head_dim = q.shape
  group = num_heads // k.shape[1]
  width = params.shape[1]
  lanes = -(-width // BLOCK) * BLOCK  # The column gradients' row.
  tables = _tables(plan, length, routing)
  delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32),
                  axis=-1, keepdims=True)
  inputs = (q, k, v, *ids, params, *tokens, *flex.routed_inputs(routing),
            d_out, lse, delta)
  by_query = _specs(plan, head_dim, group, False, _slots(routing))
  dq, d_params = _call(
      _dq_kernel, tables[:2], inputs, by_query,
      [by_query[0], pl.BlockSpec((None, None, None, 1, lanes),
                                 lambda b, n, x, t, *_: (b, n, x, 0, 0))],
      [jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((batch, num_heads, length // BLOCK, 1, lanes),
                            jnp.float32)],
      [(BLOCK, head_dim), (1, lanes)], plan)
  # Per query head; each key/value head's is the sum over its group.
  per_query_head = pl.BlockSpec((None, None, BLOCK, head_dim),
                                lambda b, n, x, t, *_: (b, n, x, 0))
  dk, dv = _call(_dkv_kernel, tables[2:], inputs,
                 _specs(plan, head_dim, group, True, _slots(routing)),
                 [per_query_head] * 2,
                 [jax.ShapeDtypeStruct(q.shape, k.dtype)] * 2,
                 [(BLOCK, head_dim)] * 2, plan)
  dk, dv = (x.reshape(batch, -1, group, length, head_dim).sum(
      2, dtype=jnp.float32).astype(k.dtype) for x in (dk, dv))
  return dq, dk, dv, None, None, None, d_params.sum((0, 2))[:, 0, :width]


# lse [B, N, T, 1] broadcasts over out [B, N, T, H] as it is.
_attention = flex.differentiable(
    _forward, _backward, heads_axis=1,
    lse_as_out=lambda lse: lse)


def attention(query: Array, key: Array, value: Array, *, score=None,
              pattern=None, scale: float, is_causal: bool,
              logit_cap: float = 0.0, q_ids_BxT: Array | None = None,
              kv_ids_BxT: Array | None = None,
              sinks: Array | None = None,
              routing: Array | None = None) -> Array:
  """flex_gpu.attention on a TPU. ValueError for a pattern of whole tiles
  (BigBird's) whose block is not a multiple of 128: its pairs cannot be
  tested inside a tile."""
  if getattr(pattern, 'tile', None) and not flex.whole_tiles(pattern, BLOCK):
    raise ValueError(f'flex_tpu takes whole tiles of a multiple of {BLOCK} '
                     f'positions, not {pattern.tile}.')
  plan = flex.Plan(flex.scores_of(score, logit_cap), pattern, BLOCK, scale,
                   is_causal)
  q, k, v, (q_ids, kv_ids), tokens, params = flex.padded_inputs(
      plan, score, query, key, value, q_ids_BxT, kv_ids_BxT)
  routing = flex.padded_routing(plan, routing, q.shape[1], False)
  # Query ids and entries as columns [B, T, 1], key ones as rows [B, 1, T].
  tokens = [x[:, :, None] if role == 'query' else x[:, None, :]
            for x, (_, role) in zip(tokens, plan.scores.layout.tokens)]
  heads_first = lambda x: jnp.transpose(x, (0, 2, 1, 3))
  out = _attention(plan, *map(heads_first, (q, k, v)),
                   (q_ids[:, :, None], kv_ids[:, None, :]), routing, tokens,
                   params, sinks)
  return heads_first(out)[:, :query.shape[1]]
