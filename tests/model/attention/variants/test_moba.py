"""moba (model/attention/variants/moba.py) equals dense attention, in
float64, under the mask of the blocks that a brute-force choice picks
(tests/helpers/moba_choice.py): for each query, its own block and the
top-k others by q . (the block's mean key)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention
from tests.helpers.compiled import compiled
from tests.helpers.moba_choice import chosen_mask

B, T, N, K, H = 2, 11, 4, 2, 8


def dense_under(q, k, v, allowed):
  """float64 softmax attention under `allowed`; rows allowing none are 0."""
  k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
  logits = np.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(H)
  logits = np.where(allowed, logits, -np.inf)
  top = np.max(logits, -1, keepdims=True)
  weights = np.exp(logits - np.where(np.isfinite(top), top, 0.0))
  weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-300)
  return np.einsum('bnts,bsnh->btnh', weights, v)


CASES = {
    # Four blocks of 3 (the last one short), two chosen besides one's own.
    'causal': dict(block=3, top_k=2, causal=True, padded=False),
    # More wanted than there are: every other block that holds a key.
    'both_ways_padded': dict(block=4, top_k=5, causal=False, padded=True),
    'causal_padded_one_chosen': dict(block=2, top_k=1, causal=True,
                                     padded=True)}


@pytest.mark.parametrize('case', CASES)
def test_moba_equals_dense_under_the_blocks_it_chooses(case):
  block, top_k, causal, padded = CASES[case].values()
  q, k, v = (np.asarray(jax.random.normal(key, shape), np.float64)
             for key, shape in zip(jax.random.split(jax.random.key(0), 3),
                                   [(B, T, N, H), (B, T, K, H), (B, T, K, H)]))
  keep = np.ones((B, T), bool)
  if padded:
    keep[1, 7:] = False
    keep[0, 4:6] = False  # A hole: a block's mean over the kept keys.
  mask = jnp.asarray(keep[:, None, None, :]) if padded else None
  allowed = chosen_mask(q, k, keep, block, top_k, causal)
  assert 0 < allowed.mean() < 0.8  # Sparse, and not empty.
  fn = compiled(attention.get('moba'))
  options = dict(block_size=block, top_k=top_k, is_causal=causal)
  got = fn(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), mask=mask,
           **options)
  rows = allowed.any(-1).transpose(0, 2, 1)[..., None]  # [B, T, N, 1]
  np.testing.assert_allclose(got, np.where(rows, dense_under(q, k, v,
                                                             allowed), 0.0),
                             atol=1e-5, rtol=1e-5)

  if case != 'causal':  # One compiled gradient suffices.
    return
  # Gradients: those of exact attention under the chosen mask (the choice
  # has none).
  def loss(fn, q, k, v):
    return jnp.sum(jnp.sin(fn(q, k, v)))
  qkv = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))
  got_grads = jax.jit(jax.grad(lambda *x: loss(
      lambda q, k, v: fn(q, k, v, mask=mask, **options), *x),
                               argnums=(0, 1, 2)))(*qkv)
  want_grads = jax.jit(jax.grad(lambda *x: loss(
      lambda q, k, v: attention.scaled_dot_product_attention(
          q, k, v, mask=jnp.asarray(allowed)), *x), argnums=(0, 1, 2)))(
              *qkv)
  for got_grad, want_grad in zip(got_grads, want_grads):
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-5, rtol=1e-5)


def test_moba_refuses_what_it_cannot_honour():
  q = jnp.zeros((1, 8, 2, 4))
  fn = compiled(attention.get('moba'))
  with pytest.raises(ValueError, match='key padding masks only'):
    fn(q, q, q, mask=jnp.ones((1, 1, 8, 8), bool))
  with pytest.raises(ValueError, match='no bias'):
    fn(q, q, q, jnp.zeros((1, 2, 8, 8)))
  with pytest.raises(ValueError, match='top_k=0'):
    fn(q, q, q, top_k=0)
