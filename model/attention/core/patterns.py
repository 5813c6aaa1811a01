"""The pairs of positions each block-sparse variant allows (sparse.py), as
the fused kernels read them: a predicate `allowed(q, k)` on query and key
positions that broadcast, causality aside; `tile`, the side of the tiles
a pattern is made of where it is made of whole tiles (None where pairs
within tiles differ); `by_offset`, whether `allowed` depends on k - q
alone; `in_tiles`, whether the pattern's sparsity lies in tiles, so
that a kernel skipping the tiles it leaves empty saves the work the
algorithm saves (strided's and fixed's every-stride-th columns reach
nearly every tile); and, but for local's window (fused_kernels.py's
rows_with_keys), `sees_keys(valid_BxT, is_causal)`: which queries see a
key that a key padding mask leaves, which dense gives zeros where none
(a pattern without it runs on the general kernel there). The general
kernel and the variants given by their functions (flex_variant.py) take
any pattern of this interface (`Moba`, whose blocks the data chooses,
the general kernel only). Frozen and hashable: a kernel's tables are
cached by pattern.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def any_between(valid_BxS: Array, first, last) -> Array:
  """[B, T] bool: whether query t has a valid key in [first[t], last[t]]
  (int arrays [T], clipped to the S keys), from prefix counts: O(B * (T +
  S))."""
  length = valid_BxS.shape[1]
  counts = jnp.pad(jnp.cumsum(valid_BxS, axis=1, dtype=jnp.int32),
                   ((0, 0), (1, 0)))
  first = np.clip(first, 0, length)
  stop = np.maximum(np.clip(last, -1, length - 1) + 1, first)
  return counts[:, stop] - counts[:, first] > 0


def _any_before(valid_BxT: Array, is_causal: bool) -> Array:
  """[B, T] bool: whether any valid key comes at or before t (causal), or
  anywhere in the row."""
  if is_causal:
    return jnp.cumsum(valid_BxT, axis=1, dtype=jnp.int32) > 0
  return jnp.broadcast_to(jnp.any(valid_BxT, axis=1, keepdims=True),
                          valid_BxT.shape)


@dataclasses.dataclass(frozen=True)
class Window:
  """local's pairs: |i - j| < window."""

  window: int
  tile = None  # Pairs within tiles differ: kernels test them.
  by_offset = True
  in_tiles = True

  def allowed(self, q, k):
    """Whether query positions `q` see key positions `k` (broadcasting;
    numpy or jax arrays), causality aside."""
    return abs(q - k) < self.window


@dataclasses.dataclass(frozen=True)
class Strided:
  """strided's pairs: |i - j| < stride, or i - j a multiple of it."""

  stride: int
  tile = None
  by_offset = True
  in_tiles = False

  def allowed(self, q, k):
    return (abs(q - k) < self.stride) | ((q - k) % self.stride == 0)

  def sees_keys(self, valid_BxT: Array, is_causal: bool) -> Array:
    batch, length = valid_BxT.shape
    t = np.arange(length)
    near = any_between(valid_BxT, t - self.stride + 1,
                        t if is_causal else t + self.stride - 1)
    # The keys congruent to t: a column of the [rows, stride] grid.
    rows = -(-length // self.stride)
    grid = jnp.pad(valid_BxT, ((0, 0), (0, rows * self.stride - length)))
    grid = jnp.swapaxes(grid.reshape(batch, rows, self.stride), 1, 2)
    column = _any_before(grid.reshape(batch * self.stride, rows), is_causal)
    column = jnp.swapaxes(column.reshape(batch, self.stride, rows), 1, 2)
    return near | column.reshape(batch, -1)[:, :length]


@dataclasses.dataclass(frozen=True)
class Fixed:
  """fixed's pairs: one block of `block`, or j among the last `summary`
  positions of its block."""

  block: int
  summary: int
  tile = None
  by_offset = False
  in_tiles = False

  def allowed(self, q, k):
    same_block = (q // self.block == k // self.block
                  if isinstance(q, np.ndarray) else
                  # Positions are >= 0: lax.div's truncation floors them
                  # (`//` floors by way of `sign`, whose lowering asks
                  # for the TPU it compiles on).
                  jax.lax.div(q, self.block) == jax.lax.div(k, self.block))
    return same_block | (k % self.block >= self.block - self.summary)

  def sees_keys(self, valid_BxT: Array, is_causal: bool) -> Array:
    t = np.arange(valid_BxT.shape[1])
    start = t // self.block * self.block
    own = any_between(valid_BxT, start,
                       t if is_causal else start + self.block - 1)
    summaries = valid_BxT & (t % self.block >= self.block - self.summary)
    return own | _any_before(summaries, is_causal)


@dataclasses.dataclass(frozen=True)
class BigBird:
  """bigbird's pairs, whole tiles of `block` x `block` positions: a query
  block's own and neighbouring key blocks, the first `num_global` blocks
  (as keys, and as queries seeing every key) and its `random_blocks` (a
  row per query block; -1 for none)."""

  block: int
  num_global: int
  random_blocks: tuple[tuple[int, ...], ...]
  by_offset = False
  in_tiles = True

  @property
  def tile(self) -> int:
    """The side of the tiles the pattern is made of: a kernel whose tiles
    divide it need not test pairs within them."""
    return self.block

  @functools.cached_property
  def _blocks(self) -> np.ndarray:
    """[blocks, blocks] bool: which key blocks a query block sees."""
    num_blocks = len(self.random_blocks)
    i, j = np.arange(num_blocks)[:, None], np.arange(num_blocks)[None, :]
    seen = ((abs(i - j) <= 1) | (i < self.num_global)
            | (j < self.num_global))
    for query_block, chosen in enumerate(self.random_blocks):
      seen[query_block, [b for b in chosen if b >= 0]] = True
    return seen

  def allowed(self, q, k):
    """As Window.allowed; numpy arrays only. Positions past the pattern's
    blocks see nothing."""
    last = len(self.random_blocks) - 1
    q_block, k_block = q // self.block, k // self.block
    return (self._blocks[np.minimum(q_block, last), np.minimum(k_block, last)]
            & (q_block <= last) & (k_block <= last))

  def sees_keys(self, valid_BxT: Array, is_causal: bool) -> Array:
    """By blocks: the key blocks holding a valid key, through the blocks
    each query block sees (before it, when causal, and its own up to the
    query)."""
    batch, length = valid_BxT.shape
    num_blocks = len(self.random_blocks)
    covered = num_blocks * self.block  # Positions past it see nothing.
    by_block = jnp.pad(valid_BxT[:, :covered],
                       ((0, 0), (0, max(covered - length, 0))))
    by_block = jnp.any(by_block.reshape(batch, num_blocks, self.block), -1)
    seen = self._blocks
    if is_causal:
      seen = np.tril(seen, -1)
    blocks_seen = jnp.einsum('bk,qk->bq', by_block.astype(jnp.int32),
                             seen.astype(np.int32)) > 0
    rows = jnp.pad(jnp.repeat(blocks_seen, self.block, axis=1)[:, :length],
                   ((0, 0), (0, max(length - covered, 0))))
    if not is_causal:
      return rows
    t = np.arange(length)
    return rows | (any_between(valid_BxT, t // self.block * self.block, t)
                   & (t < covered))


@dataclasses.dataclass(frozen=True)
class Moba:
  """moba's pairs (variants/moba.py): a query's own block of `block`
  positions, and the blocks its scores chose, which the data decides: the
  general kernel's `routing` input ([B, N, T, k] block ids, -1 for
  none) adds them to `allowed`'s, and its tile tables are computed from
  them on the device (flex.routed_tables)."""

  block: int
  tile = None
  by_offset = False
  in_tiles = True

  def allowed(self, q, k):
    """Whether query positions `q` and key positions `k` share a block
    (numpy or jax arrays), causality aside: the pairs routing leaves out."""
    if isinstance(q, np.ndarray):
      return q // self.block == k // self.block
    return jax.lax.div(q, self.block) == jax.lax.div(k, self.block)


Pattern = Window | Strided | Fixed | BigBird | Moba
