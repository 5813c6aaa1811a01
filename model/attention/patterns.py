"""The pairs of positions each block-sparse variant allows (sparse.py), as
the fused kernels read them: a predicate `allowed(q, k)` on query and key
positions that broadcast, causality aside; `tile`, the side of the tiles
a pattern is made of where it is made of whole tiles (None where pairs
within tiles differ); `by_offset`, whether `allowed` depends on k - q
alone; and `in_tiles`, whether the pattern's sparsity lies in tiles, so
that a kernel skipping the tiles it leaves empty saves the work the
algorithm saves (strided's and fixed's every-stride-th columns reach
nearly every tile). Frozen and hashable: a kernel's tables are cached by
pattern.
"""

import dataclasses
import functools

import numpy as np


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
    return ((q // self.block == k // self.block)
            | (k % self.block >= self.block - self.summary))


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


Pattern = Window | Strided | Fixed | BigBird
