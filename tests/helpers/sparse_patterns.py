"""The block-sparse variants' patterns as [T, T] bool arrays, written from
their papers' definitions, for dense's mask in the tests."""

import numpy as np


def grid(length):
  """Query positions [T, 1] and key positions [1, T]."""
  return np.arange(length)[:, None], np.arange(length)[None, :]


def _causal(allowed, causal):
  i, j = grid(len(allowed))
  return allowed & (j <= i) if causal else allowed


def local_pattern(length, window, causal):
  i, j = grid(length)
  return _causal(np.abs(i - j) < window, causal)


def strided_pattern(length, stride, causal):
  # Child et al. 2019: a local window of `stride` plus every stride-th key.
  i, j = grid(length)
  return _causal((np.abs(i - j) < stride) | ((i - j) % stride == 0), causal)


def fixed_pattern(length, block, summary, causal):
  # Child et al. 2019: one's own block plus the last `summary` of each.
  i, j = grid(length)
  return _causal((i // block == j // block)
                 | (j % block >= block - summary), causal)


def bigbird_pattern(length, block, num_global, random_blocks, causal):
  """BigBird's mask on blocks: neighbours, global rows and columns, and the
  given random blocks per query block."""
  i, j = grid(length)
  block_i, block_j = i // block, j // block
  allowed = ((np.abs(block_i - block_j) <= 1) | (block_j < num_global)
             | (block_i < num_global))
  for query_block, chosen in enumerate(random_blocks):
    for key_block in chosen[chosen >= 0]:
      allowed |= (block_i == query_block) & (block_j == key_block)
  return _causal(allowed, causal)
