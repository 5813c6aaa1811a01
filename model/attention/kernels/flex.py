"""The general fused kernel's parts that its two backends share
(flex_gpu.py: Triton; flex_tpu.py: Mosaic): which tiles a pattern
visits, the rows' ids, and a score function (core.PositionBias) as a
kernel reads it.

A kernel computes softmax(score(q.k * scale)) v over the pairs a pattern
(patterns.py; None: every pair) and causality allow, where query and key
ids are equal, with FlashAttention-2's online softmax and the gradients
recomputed from the saved log-sum-exp (Dao 2023). The score function is
traced into the kernel's body: its per-token entries (integers, e.g.
positions) come in as [B, T] arrays read tile by tile, its scalars and
tables as one float32 row per head (`Layout`), whose gradient the dq
kernel sums over the tiles it visits (the pull-back of the score
function, taken inside the kernel), so that learned slopes, tables or
temperatures train through it. Attention sinks (a logit per head in the
normaliser) are applied around the kernels, from the log-sum-exp each
forward pass returns (`with_sinks`, `differentiable`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from model.attention import core
from model.attention.core import patterns

Array = jax.Array
# A logit no softmax weight survives, finite so that a row of them stays
# finite; such weights are also zeroed where they are masked.
MASKED = -0.7 * float(np.finfo(np.float32).max)
# Ids of padded queries and keys: no real token and no each other.
_PAD_QUERY, _PAD_KEY = np.iinfo(np.int32).min, np.iinfo(np.int32).min + 1


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a score function's data reaches a kernel: `tokens`, its per-token
  entries (name, 'query' or 'key'), each a [B, T] int32 input; `params`,
  its scalars and tables (name, first column, rows or None for a scalar)
  as the columns of one float32 [N, width] input."""

  tokens: tuple[tuple[str, str], ...] = ()
  params: tuple[tuple[str, int, int | None], ...] = ()
  width: int = 1


def refusal(score: core.PositionBias | None) -> str | None:
  """Why a kernel cannot compute `score`; None if it can."""
  if score is None:
    return None
  if not score.kernel_ready:
    return (f'computes no score function of the queries or keys ('
            f'{score.name}: XLA only)')
  for name, roles in score.axes:
    free = core.free_roles(roles)
    if free and free[0] in ('query', 'key') and (
        'head' in roles or not jnp.issubdtype(
            jnp.result_type(score.data[name]), jnp.integer)):
      return (f'reads per-token entries as integers of no head axis only '
              f"({score.name}'s {name!r} is not)")
    if 'batch' in roles and not (free and free[0] in ('query', 'key')):
      return (f"reads scalars and tables per head, not per example "
              f"({score.name}'s {name!r})")
  return None


def layout_of(score: core.PositionBias | None, columns: int = 1) -> Layout:
  """The Layout of `score` (kernel-ready), its width padded to a multiple
  of `columns`."""
  if score is None:
    return Layout()
  tokens, params, width = [], [], 0
  for name, roles in score.axes:
    free = core.free_roles(roles)
    if free and free[0] in ('query', 'key'):
      tokens.append((name, free[0]))
    else:
      rows = jnp.shape(score.data[name])[roles.index(None)] if free else None
      params.append((name, width, rows))
      width += rows or 1
  return Layout(tuple(tokens), tuple(params),
                max(-(-width // columns) * columns, columns))


def inputs(score: core.PositionBias | None, layout: Layout, batch: int,
           heads: int, length: int) -> tuple[list[Array], Array]:
  """(the per-token entries [B, length] int32, padded with 0; the scalars
  and tables as columns [N, width] float32): differentiable in
  score.data, so the kernel's gradient of the columns reaches it."""
  tokens, columns = [], []
  for name, _ in layout.tokens:
    x, roles = jnp.asarray(score.data[name]), score.roles(name)
    x = (jnp.moveaxis(x, roles.index('batch'), 0) if 'batch' in roles
         else x[None])
    x = jnp.broadcast_to(x, (batch, x.shape[-1])).astype(jnp.int32)
    tokens.append(jnp.pad(x, ((0, 0), (0, length - x.shape[1]))))
  for name, _, rows in layout.params:
    x, roles = jnp.asarray(score.data[name], jnp.float32), score.roles(name)
    # [N, rows] (a table) or [N, 1] (a scalar).
    x = (jnp.moveaxis(x, roles.index('head'), -1) if 'head' in roles
         else x[..., None])
    columns.append(jnp.broadcast_to(x.reshape(rows or 1, -1).T,
                                    (heads, rows or 1)))
  used = sum(x.shape[1] for x in columns)
  columns.append(jnp.zeros((heads, layout.width - used), jnp.float32))
  return tokens, jnp.concatenate(columns, axis=1)


@dataclasses.dataclass(frozen=True)
class Scores:
  """What a kernel's body computes of a tile's q.k: the cap (core.softcap),
  then the score function `fn` (None: none) on the data of `layout`."""

  fn: object = None
  layout: Layout = Layout()
  logit_cap: float = 0.0

  def logits(self, s, tokens, params, q_index, k_index, head) -> Array:
    """`fn` reads the per-token entries as given ([bq, 1] and [1, bk]), a
    scalar column as itself, a table as a tuple of its rows' scalars
    (core.lookup)."""
    s = core.softcap(s, self.logit_cap)
    if self.fn is None:
      return s
    data = dict(tokens)
    for name, first, rows in self.layout.params:
      data[name] = (params[first] if rows is None
                    else tuple(params[first:first + rows]))
    return self.fn(s, data, q_index, k_index, head).astype(jnp.float32)


def scores_of(score: core.PositionBias | None, logit_cap: float,
              columns: int = 1) -> Scores:
  return Scores(None if score is None else score.fn,
                layout_of(score, columns), logit_cap)


@dataclasses.dataclass(frozen=True)
class Plan:
  """A kernel call's static parameters: its Scores, and the pattern (None:
  every pair), tile, scale of q.k and causality; whether the backward pass
  computes the gradient of the score's columns (not where they are
  constants, as ALiBi's slopes are: `differentiable` says)."""

  scores: Scores
  pattern: object
  tile: int
  scale: float
  is_causal: bool
  data_grads: bool = True

  @property
  def routed(self) -> bool:
    """Whether the data chose blocks (patterns.Moba): a `routing` input,
    and tables computed from it (`routed_tables`)."""
    return isinstance(self.pattern, patterns.Moba)

  def tables(self, length: int, power_of_two: bool = True, routing=None):
    """tile_tables, or under a routed pattern routed_tables of `routing`."""
    if self.routed:
      return routed_tables(self.pattern, routing, length, self.tile,
                           self.is_causal, power_of_two)
    return tile_tables(self.pattern, length, self.tile, self.is_causal,
                       power_of_two)

  def masked(self, qk, q_ids, k_ids, tokens, params, q_index, k_index,
             head, routing=None):
    """(logits [bq, bk] masked to MASKED, the mask, their pull-back:
    d_logits -> (d(q.k * scale), d_params tuple)) of a tile's q.k: the
    pairs that ids, causality and the pattern allow (ids and indices [bq,
    1] and [1, bk]), under a routed one also those of the blocks its
    queries chose (`routing`: k columns [bq, 1] of block ids, -1 for
    none)."""
    logits_of = lambda s, grads: self.scores.logits(
        s, tokens, grads if self.data_grads else params, q_index, k_index,
        head)
    logits, pull_back = jax.vjp(logits_of, qk * self.scale,
                                params if self.data_grads else ())
    mask = q_ids == k_ids
    if self.is_causal:
      mask &= q_index >= k_index
    if self.pattern is not None and not whole_tiles(self.pattern, self.tile):
      allowed = self.pattern.allowed(q_index, k_index)
      if self.routed:
        k_block = jax.lax.div(k_index, self.pattern.block)
        for column in routing:
          allowed |= column == k_block
      mask &= allowed
    return jnp.where(mask, logits, MASKED), mask, pull_back


def d_logits(s, mask, lse, delta, dp):
  """(weights, the gradient of a tile's logits s [bq, bk]) from that of
  the weights, dp: FlashAttention-2's recomputation of the weights from
  the log-sum-exp; lse and delta (rowsum(out * d_out)) [bq, 1]."""
  p = jnp.where(mask, jnp.exp(s - lse), 0.0)
  return p, p * (dp - delta)


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
  hold a pair that the pattern (None: every pair) and causality allow."""
  n = length // tile
  within = np.arange(tile)
  if pattern is None:
    return np.tri(n, dtype=bool) if is_causal else np.ones((n, n), bool)
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


def _lists(seen: np.ndarray, power_of_two: bool
           ) -> tuple[np.ndarray, np.ndarray]:
  """(lists [n, width] int32, counts [n] int32): each row's True columns in
  order, padded with the last one (0 for none) to the longest row's
  length, a power of two where asked (Triton's blocks)."""
  counts = seen.sum(axis=1).astype(np.int32)
  width = max(int(counts.max(initial=1)), 1)
  if power_of_two:
    width = 1 << (width - 1).bit_length()
  lists = np.zeros((len(seen), width), np.int32)
  for row, columns in enumerate(seen):
    found = np.flatnonzero(columns)
    lists[row, :len(found)] = found
    lists[row, len(found):] = found[-1] if len(found) else 0
  return lists, counts


@functools.lru_cache(maxsize=64)
def tile_tables(pattern, length: int, tile: int, is_causal: bool,
                power_of_two: bool = True):
  """(visits, counts, visitors, visitor_counts): each query tile's key
  tiles, and each key tile's query tiles, as `_lists`."""
  seen = touched_tiles(pattern, length, tile, is_causal)
  return (*_lists(seen, power_of_two), *_lists(seen.T, power_of_two))


def _device_lists(seen: Array, power_of_two: bool) -> tuple[Array, Array]:
  """`_lists` on the device, over the last axis of seen [..., n, m]: the
  rows m wide (a power of two where asked)."""
  counts = jnp.sum(seen, axis=-1, dtype=jnp.int32)
  width = seen.shape[-1]
  if power_of_two:
    width = 1 << (width - 1).bit_length()
  found = jnp.argsort(~seen, axis=-1, stable=True).astype(jnp.int32)
  found = jnp.pad(found, [(0, 0)] * (seen.ndim - 1)
                  + [(0, width - seen.shape[-1])])
  last = jnp.take_along_axis(found, jnp.maximum(counts - 1, 0)[..., None],
                             axis=-1)
  lists = jnp.where(jnp.arange(width) < counts[..., None], found,
                    jnp.where(counts[..., None] > 0, last, 0))
  return lists, counts


def routed_tables(pattern, routing: Array, length: int, tile: int,
                  is_causal: bool, power_of_two: bool = True):
  """tile_tables of moba's pattern (patterns.Moba), per example and
  query head, computed on the device: (visits [B, N, n, w], counts [B, N,
  n], visitors, visitor_counts), n = length // tile. A query tile visits
  the key tiles of its queries' own blocks (causally) and of every block
  one of them chose (routing [B, N, length, k], block ids, -1 for none)."""
  batch, heads, _, _ = routing.shape
  n, blocks = length // tile, -(-length // pattern.block)
  # Each query tile's chosen blocks [B, N, n, blocks] (-1 scatters past).
  hit = jnp.zeros((batch, heads, n, blocks + 1), jnp.int32).at[
      jnp.arange(batch)[:, None, None, None],
      jnp.arange(heads)[None, :, None, None],
      (jnp.arange(length) // tile)[None, None, :, None],
      jnp.where(routing < 0, blocks, routing)].set(1)[..., :blocks]
  # The key tiles each block overlaps [blocks, n].
  starts, tiles = np.arange(blocks) * pattern.block, np.arange(n) * tile
  overlaps = ((tiles[None, :] < starts[:, None] + pattern.block)
              & (tiles[None, :] + tile > starts[:, None]))
  seen = (jnp.einsum('bnqc,ck->bnqk', hit, overlaps.astype(np.int32)) > 0
          ) | touched_tiles(pattern, length, tile, is_causal)
  return (*_device_lists(seen, power_of_two),
          *_device_lists(jnp.swapaxes(seen, 2, 3), power_of_two))


def pad_length(x: Array, length: int, value=0) -> Array:
  """[B, T, ...] padded along T to `length` with `value`."""
  return jnp.pad(x, [(0, 0), (0, length - x.shape[1])]
                 + [(0, 0)] * (x.ndim - 2), constant_values=value)


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


def padded_routing(plan: Plan, routing_BxNxTxk: Array | None, length: int,
                   power_of_two: bool) -> Array | None:
  """A routed pattern's choices (block ids, -1 for none) padded along T to
  `length` and, where asked, along k to a power of two, with -1 (the
  kernels' blocks); None without. ValueError for choices without a routed
  pattern or one without them."""
  if (routing_BxNxTxk is None) == plan.routed:
    raise ValueError('routing= comes with a routed pattern '
                     '(patterns.Moba), and only with one.')
  if routing_BxNxTxk is None:
    return None
  slots = routing_BxNxTxk.shape[-1]
  if power_of_two:
    slots = 1 << (slots - 1).bit_length()
  return jnp.pad(routing_BxNxTxk.astype(jnp.int32),
                 ((0, 0), (0, 0), (0, length - routing_BxNxTxk.shape[2]),
                  (0, slots - routing_BxNxTxk.shape[3])), constant_values=-1)


def routed_inputs(routing: Array | None) -> tuple:
  """A routed pattern's choices as the kernels' input after the per-token
  entries, if any: () or (routing,)."""
  return () if routing is None else (routing,)


def padded_inputs(plan: Plan, score: core.PositionBias | None, query: Array,
                  key: Array, value: Array, q_ids_BxT: Array | None,
                  kv_ids_BxT: Array | None) -> tuple:
  """(q, k, v, ids (padded_ids), per-token entries, columns (inputs)), T
  padded to a multiple of plan.tile; [B, T, N, H] in."""
  batch, length, num_heads, _ = query.shape
  padded = -(-length // plan.tile) * plan.tile
  return (*(pad_length(x, padded) for x in (query, key, value)),
          padded_ids(q_ids_BxT, kv_ids_BxT, batch, length, padded),
          *inputs(score, plan.scores.layout, batch, num_heads, padded))


def with_sinks(out, lse, sinks_N, *, lse_as_out):
  """(out, lse) of attention over the keys -> those with each row's sink
  logit (sinks [N], the heads along lse's axis 1) one more key of value
  zero in the normaliser: lse' = logaddexp(lse, sink), out * exp(lse -
  lse'). `lse_as_out` lays an array of lse's shape out as out's,
  broadcasting over its head dim."""
  sinks = sinks_N.reshape((1, -1) + (1,) * (lse.ndim - 2))
  with_sink = jnp.logaddexp(lse, sinks)
  kept = lse_as_out(jnp.exp(lse - with_sink))
  return (out.astype(jnp.float32) * kept).astype(out.dtype), with_sink


def d_sinks(out, d_out, lse, sinks_N, *, heads_axis: int, lse_as_out):
  """The gradient of the sinks [N] of `with_sinks` (its out and lse in):
  a key of value zero, so -sum_i p_sink,i D_i, D_i = out_i . d_out_i."""
  sinks = sinks_N.reshape((1, -1) + (1,) * (lse.ndim - 2))
  product = (out.astype(jnp.float32) * d_out.astype(jnp.float32)
             * lse_as_out(jnp.exp(sinks - lse)))
  axes = tuple(axis for axis in range(product.ndim) if axis != heads_axis)
  return -jnp.sum(product, axis=axes).astype(sinks_N.dtype)


def differentiable(forward, backward, *, heads_axis: int, lse_as_out):
  """attention(plan, q, k, v, ids, routing, tokens, params, sinks): the
  output of `forward(plan, q, k, v, ids, routing, tokens, params)` (-> out,
  lse; routing: a routed pattern's block ids, else None; the heads
  along out's `heads_axis` and lse's axis 1, `lse_as_out` laying lse out
  as out), each row's sink logit (sinks [N], or None) in its normaliser
  (`with_sinks`); its gradients by `backward(plan, (q, k, v, ids,
  routing, tokens, params, out, lse), d_out)`, fed the output and
  log-sum-exp with the
  sinks (so that its weights are theirs), which computes the columns'
  only where they are differentiated (plan.data_grads), and the sinks'
  beside it (`d_sinks`)."""
  layout = dict(heads_axis=heads_axis, lse_as_out=lse_as_out)

  def forward_with_sinks(plan, *args):
    *args, sinks = args
    out, lse = forward(plan, *args)
    return (out, lse) if sinks is None else with_sinks(
        out, lse, sinks, lse_as_out=lse_as_out)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def attention(plan, *args):
    return forward_with_sinks(plan, *args)[0]

  def attention_forward(plan, *args):
    primal = jax.custom_derivatives.CustomVJPPrimal
    values = jax.tree.map(lambda arg: arg.value, args,
                          is_leaf=lambda x: isinstance(x, primal))
    out, lse = forward_with_sinks(plan, *values)
    # A pytree marker, () or None: residuals hold no Python values.
    return out, (*values, out, lse, () if args[-2].perturbed else None)

  def attention_backward(plan, residuals, d_out):
    *residuals, sinks, out, lse, perturbed = residuals
    if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
      d_out = jnp.zeros(d_out.aval.shape, d_out.aval.dtype)
    grads = backward(
        dataclasses.replace(plan, data_grads=perturbed is not None),
        (*residuals, out, lse), d_out)
    return (*grads, None if sinks is None
            else d_sinks(out, d_out, lse, sinks, **layout))

  attention.defvjp(attention_forward, attention_backward, symbolic_zeros=True)
  return attention
