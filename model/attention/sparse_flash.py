"""Block-sparse flash attention: a Pallas kernel (Triton on a GPU,
interpreted on the CPU) that computes only the tiles of queries and keys
that a block-sparse pattern (patterns.py: local's window, strided, fixed,
BigBird) touches.

Layout [B, T, N, H] as `dense`; self-attention, T padded to a multiple of
the tile. Before tracing, `tile_tables` lists for each query tile the key
tiles it visits (those holding a pair the pattern and causality allow),
and for each key tile the query tiles that visit it. A program per query
tile loops over its list with FlashAttention-2's online softmax, and the
gradients are recomputed from the saved log-sum-exp: dq by query tiles,
dk and dv by a program per key tile looping over its visitors, per query
head, summed over each key head's group afterwards (the steps of
alibi_flash.py). Inside a tile the pattern's pairs are tested on indices,
except for a pattern made of whole tiles (BigBird's blocks), whose block
is then the tile. Work: the visited tiles; O(T * keys per query) for a
pattern whose sparsity lies in tiles (local's window, BigBird), about
half of dense attention's for strided's and fixed's, whose columns reach
most tiles. Memory: O(T) beside the tables. The tables are built on the
host once per shape: O(T * tile) for a pattern of k - q alone, O(T^2)
for fixed's.
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np

from model.attention import alibi_flash

Array = jax.Array


def tile_size(pattern, length: int) -> int:
  """The kernel's tile: the pattern's own where it is made of whole tiles
  (then 16, 32, 64 or 128: fused.py refuses others), else 64 or the power
  of two >= 16 under it that covers `length`."""
  return pattern.tile or alibi_flash.block_size(length)


def whole_tiles(pattern, tile: int) -> bool:
  """Whether every tile of `tile` positions lies inside one of the
  pattern's own tiles, so that its pairs need no test."""
  return bool(pattern.tile) and pattern.tile % tile == 0


def _pairs(pattern, queries, keys, is_causal: bool) -> np.ndarray:
  """The allowed pairs of query positions [q, 1] and key positions [1, k]."""
  pairs = pattern.allowed(queries, keys)
  return pairs & (keys <= queries) if is_causal else pairs


def touched_tiles(pattern, length: int, tile: int,
                  is_causal: bool) -> np.ndarray:
  """[n, n] bool, n = length // tile: whether query tile i and key tile j
  hold a pair that the pattern (and causality) allows."""
  n = length // tile
  within = np.arange(tile)
  if whole_tiles(pattern, tile):  # One pair says a tile's.
    starts = np.arange(n) * tile
    return _pairs(pattern, starts[:, None], starts[None, :], is_causal)
  if pattern.by_offset:  # A tile's pairs depend on j - i alone.
    offsets = np.arange(1 - n, n)
    seen = np.array([_pairs(pattern, within[:, None],
                            within[None, :] + offset * tile, is_causal).any()
                     for offset in offsets])
    return seen[np.arange(n)[None, :] - np.arange(n)[:, None] + n - 1]
  keys = np.arange(length)[None, :]
  seen = np.empty((n, n), bool)
  for i in range(n):
    pairs = _pairs(pattern, i * tile + within[:, None], keys, is_causal)
    seen[i] = pairs.reshape(tile, n, tile).any(axis=(0, 2))
  return seen


def _lists(seen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(lists [n, width] int32, counts [n] int32): each row's True columns in
  order, padded with 0 to a width that is a power of two (Triton's)."""
  counts = seen.sum(axis=1).astype(np.int32)
  width = 1 << (max(int(counts.max(initial=1)), 1) - 1).bit_length()
  lists = np.zeros((len(seen), width), np.int32)
  for row, columns in enumerate(seen):
    found = np.flatnonzero(columns)
    lists[row, :len(found)] = found
  return lists, counts


@functools.lru_cache(maxsize=32)
def tile_tables(pattern, length: int, tile: int, is_causal: bool):
  """(visits, counts, visitors, visitor_counts): each query tile's key
  tiles, and each key tile's query tiles, as `_lists`."""
  seen = touched_tiles(pattern, length, tile, is_causal)
  return (*_lists(seen), *_lists(seen.T))


def _logits(q, k, q_ids, k_ids, q_index, k_index, *, pattern, tile, scale,
            is_causal):
  """(logits [bq, bk] float32 masked to alibi_flash.MASKED, the bool mask)
  of a query tile and a key tile: ids [bq] and [bk], indices likewise."""
  s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
  q_index, k_index = q_index[:, None], k_index[None, :]
  mask = q_ids[:, None] == k_ids[None, :]
  if is_causal:
    mask &= q_index >= k_index
  if not whole_tiles(pattern, tile):
    mask &= pattern.allowed(q_index, k_index)
  return jnp.where(mask, s, alibi_flash.MASKED), mask


def _forward_kernel(visits_ref, count_ref, q_ref, k_ref, v_ref, q_ids_ref,
                    k_ids_ref, o_ref, lse_ref, *, tile, **params):
  i = pl.program_id(0)
  q, q_ids = q_ref[...], q_ids_ref[...]
  q_index = i * tile + jnp.arange(tile)

  def visit(t, carry):
    j = visits_ref[t]
    keys = pl.ds(j * tile, tile)
    s, mask = _logits(q, k_ref[keys, :], q_ids, k_ids_ref[keys], q_index,
                      j * tile + jnp.arange(tile), tile=tile, **params)
    return alibi_flash.softmax_step(carry, s, mask, v_ref[keys, :])

  carry = lax.fori_loop(0, count_ref[0], visit,
                        alibi_flash.softmax_start(q.shape))
  alibi_flash.softmax_finish(carry, o_ref, lse_ref)


def _dq_kernel(visits_ref, count_ref, q_ref, k_ref, v_ref, q_ids_ref,
               k_ids_ref, do_ref, lse_ref, delta_ref, dq_ref, *, tile,
               **params):
  i = pl.program_id(0)
  q, q_ids, do = q_ref[...], q_ids_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_index = i * tile + jnp.arange(tile)

  def visit(t, dq):
    j = visits_ref[t]
    keys = pl.ds(j * tile, tile)
    k, v = k_ref[keys, :], v_ref[keys, :]
    s, mask = _logits(q, k, q_ids, k_ids_ref[keys], q_index,
                      j * tile + jnp.arange(tile), tile=tile, **params)
    return alibi_flash.dq_step(dq, s, mask, lse, delta, do, k, v)

  dq = lax.fori_loop(0, count_ref[0], visit,
                     jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * params['scale']).astype(dq_ref.dtype)


def _dkv_kernel(visitors_ref, count_ref, q_ref, k_ref, v_ref, q_ids_ref,
                k_ids_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                tile, **params):
  j = pl.program_id(0)
  k, v, k_ids = k_ref[...], v_ref[...], k_ids_ref[...]
  k_index = j * tile + jnp.arange(tile)

  def visit(t, carry):
    i = visitors_ref[t]
    queries = pl.ds(i * tile, tile)
    q = q_ref[queries, :]
    s, mask = _logits(q, k, q_ids_ref[queries], k_ids,
                      i * tile + jnp.arange(tile), k_index, tile=tile,
                      **params)
    return alibi_flash.dkv_step(carry, s, mask, lse_ref[queries],
                                delta_ref[queries], q, do_ref[queries, :], v)

  dk, dv = lax.fori_loop(0, count_ref[0], visit,
                         (jnp.zeros(k.shape, jnp.float32),
                          jnp.zeros(v.shape, jnp.float32)))
  dk_ref[...] = (dk * params['scale']).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _table_specs(width: int) -> list[pl.BlockSpec]:
  """A grid program's row of a tile table [n, width] and its count."""
  return [pl.BlockSpec((None, width), lambda i, b, n: (i, 0)),
          pl.BlockSpec((1,), lambda i, b, n: (i,))]


def _specs(tile: int, length: int, group: int, head_dim: int,
           by_key_tile: bool) -> list[pl.BlockSpec]:
  """BlockSpecs over the grid (tile, example b, query head n) of q, k, v,
  query ids and key ids: by query tile, the query head's tile and the key
  head's whole rows; by key tile, the query head's whole rows and the key
  head's tile."""
  query = (lambda i, b, n: (b, 0, n, 0)) if by_key_tile else (
      lambda i, b, n: (b, i, n, 0))
  keys = (lambda i, b, n: (b, i, n // group, 0)) if by_key_tile else (
      lambda i, b, n: (b, 0, n // group, 0))
  rows = pl.BlockSpec((None, length), lambda i, b, n: (b, 0))
  tile_of_row = pl.BlockSpec((None, tile), lambda i, b, n: (b, i))
  query_ids, key_ids = (rows, tile_of_row) if by_key_tile else (
      tile_of_row, rows)
  q_len, k_len = (length, tile) if by_key_tile else (tile, length)
  return [pl.BlockSpec((None, q_len, None, head_dim), query),
          pl.BlockSpec((None, k_len, None, head_dim), keys),
          pl.BlockSpec((None, k_len, None, head_dim), keys), query_ids,
          key_ids]


def _forward(q, k, v, ids, pattern, tile, scale, is_causal):
  batch, length, num_heads, head_dim = q.shape
  visits, counts = tile_tables(pattern, length, tile, is_causal)[:2]
  specs = _specs(tile, length, num_heads // k.shape[2], head_dim, False)
  return alibi_flash.call_kernel(
      _forward_kernel, (visits, counts, q, k, v, *ids),
      _table_specs(visits.shape[1]) + specs,
      [specs[0], alibi_flash.per_query_block(tile)],
      [jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((batch, num_heads, length), jnp.float32)],
      (length // tile, batch, num_heads), name='sparse_flash_forward',
      head_dim=head_dim, tile=tile, pattern=pattern, scale=scale,
      is_causal=is_causal)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q, k, v, ids, pattern, tile, scale, is_causal):
  return _forward(q, k, v, ids, pattern, tile, scale, is_causal)[0]


def _attention_forward(q, k, v, ids, pattern, tile, scale, is_causal):
  out, lse = _forward(q, k, v, ids, pattern, tile, scale, is_causal)
  return out, (q, k, v, ids, out, lse)


def _attention_backward(pattern, tile, scale, is_causal, residuals, d_out):
  q, k, v, ids, out, lse = residuals
  batch, length, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  visits, counts, visitors, visitor_counts = tile_tables(
      pattern, length, tile, is_causal)
  delta = jnp.einsum('btnh,btnh->bnt', out.astype(jnp.float32),
                     d_out.astype(jnp.float32))
  grid = (length // tile, batch, num_heads)
  params = dict(head_dim=head_dim, tile=tile, pattern=pattern, scale=scale,
                is_causal=is_causal)
  specs = _specs(tile, length, group, head_dim, False)
  per_tile = alibi_flash.per_query_block(tile)
  dq = alibi_flash.call_kernel(
      _dq_kernel, (visits, counts, q, k, v, *ids, d_out, lse, delta),
      _table_specs(visits.shape[1]) + specs + [specs[0], per_tile, per_tile],
      specs[0], jax.ShapeDtypeStruct(q.shape, q.dtype), grid,
      name='sparse_flash_dq', **params)
  specs = _specs(tile, length, group, head_dim, True)
  rows_of_head = pl.BlockSpec((None, None, length), lambda j, b, n: (b, n, 0))
  per_query_head = pl.BlockSpec((None, tile, None, head_dim),
                                lambda j, b, n: (b, j, n, 0))
  dk, dv = alibi_flash.call_kernel(
      _dkv_kernel,
      (visitors, visitor_counts, q, k, v, *ids, d_out, lse, delta),
      _table_specs(visitors.shape[1]) + specs
      + [specs[0], rows_of_head, rows_of_head],
      [per_query_head, per_query_head],
      [jax.ShapeDtypeStruct(q.shape, k.dtype)] * 2, grid,
      name='sparse_flash_dkv', **params)
  # Each key/value head's gradient: the sum over the query heads it serves.
  dk, dv = (x.reshape(batch, length, num_kv_heads, group, head_dim).sum(
      3, dtype=jnp.float32).astype(k.dtype) for x in (dk, dv))
  return dq, dk, dv, None


_attention.defvjp(_attention_forward, _attention_backward)


def attention(query: Array, key: Array, value: Array, pattern, *,
              scale: float, is_causal: bool, q_ids_BxT: Array | None = None,
              kv_ids_BxT: Array | None = None) -> Array:
  """softmax(q.k * scale) v over the pairs `pattern.allowed` (a patterns.py
  Pattern) where query i and key j have equal ids (default: all do; the
  keys' default to the queries'; key ids alone are refused) and, when
  causal, j <= i; [B, T, N, H]. A query that sees no key gives 0."""
  batch, length = query.shape[:2]
  tile = tile_size(pattern, length)
  padded = -(-length // tile) * tile
  ids = alibi_flash.padded_ids(q_ids_BxT, kv_ids_BxT, batch, length, padded)
  q, k, v = (alibi_flash.pad_length(x, padded) for x in (query, key, value))
  return _attention(q, k, v, ids, pattern, tile, scale, is_causal)[:, :length]
