"""The pairs moba attends (model/attention/variants/moba.py), found by
brute force: for each query, its own block and the top-k others by q .
(the block's mean key), as a dense mask for the tests' references."""

import numpy as np


def chosen_mask(q, k, keep, block, top_k, causal) -> np.ndarray:
  """bool [B, N, T, T] of q [B, T, N, H], k [B, T, K, H] and keep [B, T]
  (False: a padded key), by looping over the examples, heads, blocks and
  queries (float64)."""
  batch, length, heads, _ = q.shape
  group = heads // k.shape[2]
  count = -(-length // block)
  of = np.arange(length) // block  # Each position's block.
  allowed = np.zeros((batch, heads, length, length), bool)
  for b in range(batch):
    for n in range(heads):
      means = {}
      for c in range(count):
        kept = (of == c) & keep[b]
        if kept.any():
          means[c] = k[b, kept, n // group].mean(0)
      for t in range(length):
        others = [c for c in means if (c < of[t] if causal else c != of[t])]
        ranked = sorted(others, key=lambda c: -q[b, t, n] @ means[c])
        own = (of == of[t]) & ((np.arange(length) <= t) | (not causal))
        allowed[b, n, t] = keep[b] & (own | np.isin(of, ranked[:top_k]))
  return allowed
