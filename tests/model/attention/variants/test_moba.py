"""moba (model/attention/variants/moba.py) equals dense attention, in
float64, under the mask of the blocks that a brute-force choice picks
(tests/helpers/moba_choice.py): for each query, its own block and the
top-k others by q . (the block's mean key). On the general fused kernel
(interpreted) it equals its XLA form, and the kernel's tile tables,
computed from the choice, are those the brute-force mask touches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention
from model.attention.core import patterns
from model.attention.kernels import flex
from model.attention.variants import moba
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


def routed_case(length=136):
  """(q, k, v, keep) whose queries all rank blocks of the first 64
  positions best (they and those blocks' keys share a direction), so that
  a later query tile of 64 skips the tiles between: q [2, T, 4, 16], k
  and v [2, T, 2, 16]; keep [2, T], the second row padded from 110."""
  rng = np.random.default_rng(1)  # numpy's: eager jax ops compile each.
  q = rng.standard_normal((2, length, 4, 16), np.float32)
  k, v = rng.standard_normal((2, 2, length, 2, 16), np.float32)
  shared = rng.standard_normal(16, np.float32)
  q += 4 * shared
  k[:, :64] += 4 * shared
  keep = np.ones((2, length), bool)
  keep[1, 110:] = False
  return q, k, v, keep


@pytest.mark.parametrize('kernel', ['pallas_gpu', 'pallas_tpu'])
def test_moba_on_the_general_kernel_equals_its_xla_form(kernel):
  """Causal, key padding, grouped heads and sinks; outputs and the
  gradients of q, k, v and the sinks."""
  q, k, v, keep = routed_case()
  sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0])
  options = dict(mask=jnp.asarray(keep[:, None, None]), block_size=16,
                 top_k=2, is_causal=True)

  def value_and_grads(q, k, v, sinks, kernel):
    def loss(*args):
      return jnp.sum(jnp.sin(attention.get('moba')(
          *args[:3], sinks=args[3], kernel=kernel, **options)))
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

  value_and_grads = jax.jit(value_and_grads, static_argnums=4)
  want, got = (value_and_grads(q, k, v, sinks, name)
               for name in ('xla', kernel))
  for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(got_leaf, want_leaf, atol=2e-5, rtol=2e-5)


def test_moba_tile_tables_are_the_tiles_its_choice_touches():
  """flex.routed_tables of the choice against the tiles of 64 that the
  brute-force mask touches (no padding: the choice alone); later query
  tiles skip the tiles between, and the key tiles' lists are the same
  pairs transposed."""
  q, k, _, _ = routed_case()
  keep = np.ones((2, 136), bool)
  length, tile = 192, 64

  @jax.jit  # One program: eagerly, an op-by-op compile each.
  def tables(q, k):
    blocks, chosen = moba.chosen_blocks(
        *(jnp.pad(x, ((0, 0), (0, 8), (0, 0), (0, 0))) for x in (q, k)),
        jnp.ones((2, 144), bool), block_size=16, top_k=2, is_causal=True)
    routing = jnp.pad(jnp.where(chosen, blocks, -1)[:, :, :136],
                      ((0, 0), (0, 0), (0, length - 136), (0, 0)),
                      constant_values=-1)
    return flex.routed_tables(patterns.Moba(16), routing, length, tile,
                              is_causal=True)

  visits, counts, visitors, visitor_counts = tables(q, k)
  allowed = np.pad(chosen_mask(np.asarray(q, np.float64),
                               np.asarray(k, np.float64), keep, 16, 2, True),
                   ((0, 0), (0, 0), (0, 56), (0, 56)))
  # Padded queries still see their own block's tiles (ids mask them).
  allowed |= np.tri(length, dtype=bool) & (
      np.arange(length)[:, None] // 16 == np.arange(length)[None, :] // 16)
  want = allowed.reshape(2, 4, 3, tile, 3, tile).any(axis=(3, 5))
  got = np.zeros_like(want)
  for index in np.ndindex(*counts.shape):
    got[index][visits[index][:counts[index]]] = True
  np.testing.assert_array_equal(got, want)
  assert not want[:, :, 2, 1].any()  # Tile 2 skips tile 1.
  got_by_key = np.zeros_like(want)
  for index in np.ndindex(*visitor_counts.shape):
    got_by_key[index][visitors[index][:visitor_counts[index]]] = True
  np.testing.assert_array_equal(got_by_key, np.swapaxes(want, 2, 3))


@pytest.mark.parametrize('kernel', ['gpu', 'tpu'])
def test_moba_on_the_general_kernel_lowers_for_its_accelerator(
    monkeypatch, kernel):
  """Its gradient exported for a GPU (Triton) or a TPU (Mosaic) from this
  CPU, not interpreted: the forward, dq and dk/dv kernels, three calls."""
  platform, call = {'gpu': ('cuda', '__gpu$xla.gpu.triton'),
                    'tpu': ('tpu', 'tpu_custom_call')}[kernel]
  monkeypatch.setattr(jax, 'default_backend', lambda: kernel)

  def loss(q, k, v, sinks):
    return jnp.sum(attention.get('moba')(
        q, k, v, mask=jnp.ones((2, 1, 1, 256), bool), block_size=64,
        top_k=2, is_causal=True, sinks=sinks,
        kernel=f'pallas_{kernel}').astype(jnp.float32))

  shape = lambda heads: jax.ShapeDtypeStruct((2, 256, heads, 64),
                                             jnp.bfloat16)
  exported = jax.export.export(
      jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(call)])(
          shape(4), shape(2), shape(2),
          jax.ShapeDtypeStruct((4,), jnp.float32))
  assert exported.mlir_module().count(f'@{call}(') == 3
