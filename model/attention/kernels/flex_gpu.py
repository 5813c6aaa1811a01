"""The general fused kernel (flex.py) on a GPU: a Pallas kernel in Triton
(the CPU interprets it) for any score function and block pattern. Layout
[B, T, N, H] as `dense`; self-attention, T padded to a multiple of the
tile. A program per query tile, example and head loops over the key
tiles its row of the tile table lists (`flex.tile_tables`: those holding
a pair the pattern and causality allow), with the online softmax; dq by
the same programs, which also sum the score function's column gradients
over their tiles; dk and dv by a program per key tile looping over the
query tiles that visit it, per query head, summed over each key head's
group afterwards. Inside a tile the pattern's pairs are tested on
indices, except for a pattern made of whole tiles (BigBird's blocks),
whose block is then the tile. Under moba's routed pattern the tables
hold a row per example, head and tile, computed on the device from the
blocks each query chose (flex.routed_tables), and the tile's queries'
choices come in beside their rows. Work: the visited tiles, O(T * keys per
query) for a pattern whose sparsity lies in tiles. Memory: O(T).
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from model.attention.kernels import flex

Array = jax.Array


def tile_size(pattern, length: int) -> int:
  """The kernel's tile: the pattern's own where it is made of whole tiles
  (16, 32, 64 or 128; 128 for a multiple of it: fused.py refuses others),
  else 64 or the power of two >= 16 under it that covers `length`."""
  if getattr(pattern, 'tile', None):
    return min(pattern.tile, 128)
  return min(64, max(16, 1 << (length - 1).bit_length()))


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _tokens(plan: flex.Plan, refs, by_key_tile: bool, other):
  """A tile's per-token entries ([bq, 1] and [1, bk]) from their refs: the
  program's own side whole, the other side's rows at `other`."""
  tokens = {}
  for (name, role), ref in zip(plan.scores.layout.tokens, refs):
    own = (role == 'key') == by_key_tile
    x = ref[...] if own else ref[other]
    tokens[name] = x[:, None] if role == 'query' else x[None, :]
  return tokens


def _tile(plan: flex.Plan, q, k, q_ids, k_ids, tokens, params, i, j, head,
          routing):
  """plan.masked of query tile i against key tile j (`routing`: the query
  tile's chosen blocks, or None)."""
  return plan.masked(
      _dot(q, k.T), q_ids[:, None], k_ids[None, :], tokens, params,
      (i * plan.tile + jnp.arange(plan.tile))[:, None],
      (j * plan.tile + jnp.arange(plan.tile))[None, :], head, routing)


def _split(plan: flex.Plan, refs) -> tuple:
  """(the per-token entries' refs, the routing's or None, the rest)."""
  tokens = len(plan.scores.layout.tokens)
  routing = refs[tokens] if plan.routed else None
  return refs[:tokens], routing, refs[tokens + plan.routed:]


def _columns(routing_ref, rows) -> tuple | None:
  """A routed pattern's choices at `rows` as columns [rows, 1], one per
  slot (Triton lowers no slice of a loaded block); None without."""
  if routing_ref is None:
    return None
  return tuple(routing_ref[rows, slot][:, None]
               for slot in range(routing_ref.shape[1]))


def _params(plan: flex.Plan, params_ref) -> tuple:
  return tuple(params_ref[c] for c in range(plan.scores.layout.width))


def _forward_kernel(visits_ref, count_ref, q_ref, k_ref, v_ref, q_ids_ref,
                    k_ids_ref, params_ref, *refs, plan):
  token_refs, routing_ref, (o_ref, lse_ref) = _split(plan, refs)
  i, head = pl.program_id(0), pl.program_id(2)
  q, q_ids, params = q_ref[...], q_ids_ref[...], _params(plan, params_ref)
  routing = _columns(routing_ref, slice(None))

  def visit(t, carry):
    j = visits_ref[t]
    keys = pl.ds(j * plan.tile, plan.tile)
    s, mask, _ = _tile(plan, q, k_ref[keys, :], q_ids, k_ids_ref[keys],
                       _tokens(plan, token_refs, False, keys), params, i, j,
                       head, routing)
    acc, m, l = carry
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
    correction = jnp.exp(m - m_next)
    v = v_ref[keys, :]
    acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_next, l * correction + jnp.sum(p, axis=1)

  acc, m, l = lax.fori_loop(
      0, count_ref[0], visit,
      (jnp.zeros(q.shape, jnp.float32),
       jnp.full((plan.tile,), flex.MASKED, jnp.float32),
       jnp.zeros((plan.tile,), jnp.float32)))
  # A query that saw no key (sum 0) comes out 0, as from dense.
  l = jnp.where(l == 0.0, 1.0, l)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _dq_kernel(visits_ref, count_ref, q_ref, k_ref, v_ref, q_ids_ref,
               k_ids_ref, params_ref, *refs, plan):
  token_refs, routing_ref, (do_ref, lse_ref, delta_ref, dq_ref,
                            d_params_ref) = _split(plan, refs)
  i, head = pl.program_id(0), pl.program_id(2)
  q, q_ids, do = q_ref[...], q_ids_ref[...], do_ref[...]
  routing = _columns(routing_ref, slice(None))
  lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
  params = _params(plan, params_ref)
  columns = jnp.arange(plan.scores.layout.width)

  def visit(t, carry):
    dq, d_params = carry
    j = visits_ref[t]
    keys = pl.ds(j * plan.tile, plan.tile)
    k, v = k_ref[keys, :], v_ref[keys, :]
    s, mask, pull_back = _tile(plan, q, k, q_ids, k_ids_ref[keys],
                               _tokens(plan, token_refs, False, keys),
                               params, i, j, head, routing)
    _, d_logits = flex.d_logits(s, mask, lse, delta, _dot(do, v.T))
    ds, d_columns = pull_back(d_logits)
    for column, d in enumerate(d_columns):
      d_params = d_params + jnp.where(columns == column, d, 0.0)
    return dq + _dot(ds.astype(k.dtype), k), d_params

  dq, d_params = lax.fori_loop(
      0, count_ref[0], visit,
      (jnp.zeros(q.shape, jnp.float32),
       jnp.zeros((plan.scores.layout.width,), jnp.float32)))
  dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)
  d_params_ref[...] = d_params


def _dkv_kernel(visitors_ref, count_ref, q_ref, k_ref, v_ref, q_ids_ref,
                k_ids_ref, params_ref, *refs, plan):
  token_refs, routing_ref, (do_ref, lse_ref, delta_ref, dk_ref, dv_ref) = (
      _split(plan, refs))
  j, head = pl.program_id(0), pl.program_id(2)
  k, v, k_ids = k_ref[...], v_ref[...], k_ids_ref[...]
  params = _params(plan, params_ref)

  def visit(t, carry):
    dk, dv = carry
    i = visitors_ref[t]
    queries = pl.ds(i * plan.tile, plan.tile)
    q, do = q_ref[queries, :], do_ref[queries, :]
    s, mask, pull_back = _tile(
        plan, q, k, q_ids_ref[queries], k_ids,
        _tokens(plan, token_refs, True, queries), params, i, j, head,
        _columns(routing_ref, queries))
    p, d_logits = flex.d_logits(s, mask, lse_ref[queries][:, None],
                                delta_ref[queries][:, None], _dot(do, v.T))
    ds, _ = pull_back(d_logits)
    return (dk + _dot(ds.T.astype(q.dtype), q),
            dv + _dot(p.T.astype(do.dtype), do))

  dk, dv = lax.fori_loop(0, count_ref[0], visit,
                         (jnp.zeros(k.shape, jnp.float32),
                          jnp.zeros(v.shape, jnp.float32)))
  dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(plan: flex.Plan, length: int, group: int, head_dim: int,
           by_key_tile: bool, routing=None) -> list[pl.BlockSpec]:
  """BlockSpecs over the grid (tile, example b, query head n) of q, k, v,
  query ids, key ids, the columns, the per-token entries and a routed
  pattern's choices ([B, N, T, k]): by query tile, the query head's tile
  and the key head's whole rows; by key tile, the query head's whole rows
  and the key head's tile."""
  tile = plan.tile
  query = (lambda x, b, n: (b, 0, n, 0)) if by_key_tile else (
      lambda x, b, n: (b, x, n, 0))
  keys = (lambda x, b, n: (b, x, n // group, 0)) if by_key_tile else (
      lambda x, b, n: (b, 0, n // group, 0))
  rows = pl.BlockSpec((None, length), lambda x, b, n: (b, 0))
  tile_of_row = pl.BlockSpec((None, tile), lambda x, b, n: (b, x))
  query_rows, key_rows = (rows, tile_of_row) if by_key_tile else (
      tile_of_row, rows)
  q_len, k_len = (length, tile) if by_key_tile else (tile, length)
  columns = pl.BlockSpec((None, plan.scores.layout.width),
                         lambda x, b, n: (n, 0))
  routing = [] if routing is None else [pl.BlockSpec(
      (None, None, q_len, routing.shape[-1]),
      (lambda x, b, n: (b, n, 0, 0)) if by_key_tile else (
          lambda x, b, n: (b, n, x, 0)))]
  return [pl.BlockSpec((None, q_len, None, head_dim), query),
          pl.BlockSpec((None, k_len, None, head_dim), keys),
          pl.BlockSpec((None, k_len, None, head_dim), keys), query_rows,
          key_rows, columns] + [
              query_rows if role == 'query' else key_rows
              for _, role in plan.scores.layout.tokens] + routing


def _table_specs(table: Array) -> list[pl.BlockSpec]:
  """A grid program's row of a tile table and its count: [n, width] and
  [n], or a routed pattern's [B, N, n, width] and [B, N, n]."""
  width = table.shape[-1]
  if table.ndim == 2:
    return [pl.BlockSpec((None, width), lambda x, b, n: (x, 0)),
            pl.BlockSpec((1,), lambda x, b, n: (x,))]
  return [pl.BlockSpec((None, None, None, width),
                       lambda x, b, n: (b, n, x, 0)),
          pl.BlockSpec((None, None, 1), lambda x, b, n: (b, n, x))]


def _call(kernel, inputs, in_specs, out_specs, out_shape, grid, *, name,
          plan, head_dim: int):
  """`kernel` as a pallas_call: Triton on a GPU, interpreted on the CPU."""
  return pl.pallas_call(
      functools.partial(kernel, plan=plan), grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape, name=name,
      compiler_params=plgpu.CompilerParams(
          num_warps=4 if head_dim <= 64 else 8, num_stages=2),
      interpret=jax.default_backend() == 'cpu')(*inputs)


def _per_query_tile(tile: int) -> pl.BlockSpec:
  """A query tile's log-sum-exp or delta, of [B, N, T] float32."""
  return pl.BlockSpec((None, None, tile), lambda x, b, n: (b, n, x))


def _forward(plan, q, k, v, ids, routing, tokens, params):
  batch, length, num_heads, head_dim = q.shape
  visits, counts = plan.tables(length, routing=routing)[:2]
  specs = _specs(plan, length, num_heads // k.shape[2], head_dim, False,
                 routing)
  return _call(
      _forward_kernel, (visits, counts, q, k, v, *ids, params, *tokens,
                        *flex.routed_inputs(routing)),
      _table_specs(visits) + specs,
      [specs[0], _per_query_tile(plan.tile)],
      [jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((batch, num_heads, length), jnp.float32)],
      (length // plan.tile, batch, num_heads), name='flex_forward',
      plan=plan, head_dim=head_dim)


def _backward(plan, residuals, d_out):
  q, k, v, ids, routing, tokens, params, out, lse = residuals
  batch, length, num_heads, head_dim = q.shape
  group = num_heads // k.shape[2]
  tile = plan.tile
  visits, counts, visitors, visitor_counts = plan.tables(length,
                                                         routing=routing)
  delta = jnp.einsum('btnh,btnh->bnt', out.astype(jnp.float32),
                     d_out.astype(jnp.float32))
  grid = (length // tile, batch, num_heads)
  specs = _specs(plan, length, group, head_dim, False, routing)
  per_tile = _per_query_tile(tile)
  width = plan.scores.layout.width
  dq, d_params = _call(
      _dq_kernel, (visits, counts, q, k, v, *ids, params, *tokens,
                   *flex.routed_inputs(routing), d_out, lse, delta),
      _table_specs(visits) + specs + [specs[0], per_tile, per_tile],
      [specs[0], pl.BlockSpec((None, None, None, width),
                              lambda x, b, n: (x, b, n, 0))],
      [jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((*grid, width), jnp.float32)], grid,
      name='flex_dq', plan=plan, head_dim=head_dim)
  specs = _specs(plan, length, group, head_dim, True, routing)
  rows_of_head = pl.BlockSpec((None, None, length), lambda x, b, n: (b, n, 0))
  per_query_head = pl.BlockSpec((None, tile, None, head_dim),
                                lambda x, b, n: (b, x, n, 0))
  dk, dv = _call(
      _dkv_kernel, (visitors, visitor_counts, q, k, v, *ids, params,
                    *tokens, *flex.routed_inputs(routing), d_out, lse,
                    delta),
      _table_specs(visitors) + specs
      + [specs[0], rows_of_head, rows_of_head],
      [per_query_head, per_query_head],
      [jax.ShapeDtypeStruct(q.shape, k.dtype)] * 2, grid,
      name='flex_dkv', plan=plan, head_dim=head_dim)
  # Each key/value head's gradient: the sum over the query heads it serves.
  dk, dv = (x.reshape(batch, length, -1, group, head_dim).sum(
      3, dtype=jnp.float32).astype(k.dtype) for x in (dk, dv))
  return dq, dk, dv, None, None, None, d_params.sum((0, 1))


# lse [B, N, T] is laid out as out [B, T, N, H] by moving its heads.
_attention = flex.differentiable(
    _forward, _backward, heads_axis=2,
    lse_as_out=lambda lse: jnp.moveaxis(lse, 1, 2)[..., None])


def attention(query: Array, key: Array, value: Array, *, score=None,
              pattern=None, scale: float, is_causal: bool,
              logit_cap: float = 0.0, q_ids_BxT: Array | None = None,
              kv_ids_BxT: Array | None = None,
              sinks: Array | None = None,
              routing: Array | None = None) -> Array:
  """softmax(score(cap(q.k * scale))) v over the pairs `pattern.allowed`
  (a patterns.py Pattern; None: every pair; under a patterns.Moba one
  also those of the blocks `routing` [B, N, T, k] names for each query
  and head, -1 for none) where query i and key j have
  equal ids (default: all do; the keys' default to the queries'; key ids
  alone are refused) and, when causal, j <= i; [B, T, N, H]. `score`: a
  kernel-ready core.PositionBias (flex.refusal) or None; `logit_cap` as
  core.softcap's; `sinks` [N] float32, a logit per head in each row's
  normaliser (core.sink_softmax), or None. A query that sees no key gives
  0."""
  # Triton's blocks are powers of two: so are the columns'.
  columns = 1 << (flex.layout_of(score).width - 1).bit_length()
  plan = flex.Plan(flex.scores_of(score, logit_cap, columns), pattern,
                   tile_size(pattern, query.shape[1]), scale, is_causal)
  q, k, v, ids, tokens, params = flex.padded_inputs(
      plan, score, query, key, value, q_ids_BxT, kv_ids_BxT)
  routing = flex.padded_routing(plan, routing, q.shape[1], True)
  return _attention(plan, q, k, v, ids, routing, tokens, params,
                    sinks)[:, :query.shape[1]]
