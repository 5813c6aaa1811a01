"""The attention core against a float64 NumPy reference and jax.nn."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention, positions
from tests.helpers import tolerance
from tests.helpers.compiled import compiled

B, T, N, H = 2, 8, 4, 16


def numpy_attention(q, k, v, bias=None, mask=None, scale=None, causal=False,
                    logit_cap=0.0):
  """Float64 reference with heads repeated explicitly; returns (out, probs).

  Query head n reads key head n // (N // K); rows with no key are zero.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  num_heads, num_kv_heads = q.shape[2], k.shape[2]
  k = np.repeat(k, num_heads // num_kv_heads, axis=2)
  v = np.repeat(v, num_heads // num_kv_heads, axis=2)
  scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
  logits = np.einsum('btnh,bsnh->bnts', q, k) * scale
  if logit_cap:
    logits = logit_cap * np.tanh(logits / logit_cap)
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  allowed = np.ones(logits.shape, bool)
  if mask is not None:
    allowed &= np.asarray(mask)
  if causal:
    t_len, s_len = logits.shape[-2:]
    allowed &= (np.arange(s_len)[None, :]
                <= np.arange(t_len)[:, None] + (s_len - t_len))
  probs = np.zeros_like(logits)
  for idx in np.ndindex(*logits.shape[:-1]):
    keep = allowed[idx]
    if keep.any():
      e = np.exp(logits[idx][keep] - logits[idx][keep].max())
      probs[idx][keep] = e / e.sum()
  return np.einsum('bnts,bsnh->btnh', probs, v), probs


def make_qkv(seed, num_kv_heads=N, q_len=T, kv_len=T, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (B, q_len, N, H), dtype)
  k = jax.random.normal(kk, (B, kv_len, num_kv_heads, H), dtype)
  v = jax.random.normal(kv, (B, kv_len, num_kv_heads, H), dtype)
  return q, k, v


def padding(kv_len=T):
  """[B, 1, 1, S]: example 0 sees all keys, example 1 the first 5."""
  lengths = np.array([kv_len, 5])
  return jnp.asarray(np.arange(kv_len)[None, :] < lengths[:, None])[
      :, None, None, :]


def random_bias(seed, kv_len=T):
  return jax.random.normal(jax.random.key(seed), (1, N, T, kv_len))


CASES = {
    'plain': dict(),
    'padding_mask': dict(mask=padding()),
    'causal': dict(is_causal=True),
    'bias': dict(bias=random_bias(7)),
    'scale': dict(scale=0.3),
    'gqa': dict(num_kv_heads=2),
    'mqa': dict(num_kv_heads=1),
    'all_together': dict(num_kv_heads=2, mask=padding(), bias=random_bias(8),
                         is_causal=True, scale=0.2),
}


def split_case(case):
  case = dict(case)
  num_kv_heads = case.pop('num_kv_heads', N)
  return num_kv_heads, case


@pytest.mark.parametrize('name', CASES)
def test_matches_float64_reference(name):
  num_kv_heads, kwargs = split_case(CASES[name])
  q, k, v = make_qkv(0, num_kv_heads)
  out = attention.scaled_dot_product_attention(q, k, v, **kwargs)
  expected, _ = numpy_attention(
      q, k, v, kwargs.get('bias'), kwargs.get('mask'), kwargs.get('scale'),
      kwargs.get('is_causal', False))
  assert out.shape == (B, T, N, H) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize('name', CASES)
def test_output_and_gradients_match_jax_nn(name):
  """Outputs and the vector-Jacobian products of one cotangent, element by
  element (not their sum, whose terms cancel to a few ulps of error)."""
  num_kv_heads, kwargs = split_case(CASES[name])
  q, k, v = make_qkv(1, num_kv_heads)
  cotangent = jax.random.normal(jax.random.key(2), (B, T, N, H))

  def output_and_vjp(fn):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kwargs), q, k, v)
    return out, vjp(cotangent)

  chex.assert_trees_all_close(
      output_and_vjp(attention.scaled_dot_product_attention),
      output_and_vjp(jax.nn.dot_product_attention), **tolerance.FLOAT32)


def capped_reference(q, k, v, bias, mask, logit_cap):
  """Causal attention with capped scores, written in jnp with heads
  repeated: what autodiff differentiates for the gradients' reference."""
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  scores = jnp.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(q.shape[-1])
  logits = logit_cap * jnp.tanh(scores / logit_cap) + bias
  allowed = mask & np.tril(np.ones((T, T), bool))
  weights = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
  return jnp.einsum('bnts,bsnh->btnh', weights, v)


@pytest.mark.parametrize('name, options', [
    ('dense', {}), ('chunked', dict(chunk_size=4, kernel='xla'))])
def test_a_logit_cap_matches_the_references_with_gradients(name, options):
  """cap * tanh(q . k * scale / cap) before the bias and mask: GQA, causal,
  a padding mask and a bias; the cap (0.5) bites on most scores. chunked's
  own backward pass against autodiff of the reference."""
  q, k, v = make_qkv(3, num_kv_heads=2)
  bias, mask = random_bias(9), padding()
  fn = compiled(attention.get(name))
  out = fn(q, k, v, bias, mask, is_causal=True, logit_cap=0.5, **options)
  np.testing.assert_allclose(
      out, numpy_attention(q, k, v, bias, mask, causal=True,
                           logit_cap=0.5)[0], atol=2e-6, rtol=2e-6)
  cotangent = jax.random.normal(jax.random.key(4), (B, T, N, H))
  ours = jax.jit(jax.grad(lambda *x: jnp.sum(fn(*x, mask, is_causal=True,
                                                logit_cap=0.5, **options)
                                             * cotangent),
                          argnums=(0, 1, 2, 3)))(q, k, v, bias)
  want = jax.jit(jax.grad(lambda *x: jnp.sum(capped_reference(*x, mask, 0.5)
                                             * cotangent),
                          argnums=(0, 1, 2, 3)))(q, k, v, bias)
  chex.assert_trees_all_close(ours, want, atol=2e-5, rtol=2e-5)


@pytest.mark.core
def test_attention_weights_match_reference_and_sum_to_one():
  q, k, _ = make_qkv(3, num_kv_heads=2)
  mask = padding()
  weights = attention.attention_weights(q, k, mask=mask, is_causal=True)
  _, expected = numpy_attention(q, k, k, mask=mask, causal=True)
  assert weights.shape == (B, N, T, T) and weights.dtype == jnp.float32
  np.testing.assert_allclose(weights, expected, atol=1e-6)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.core
def test_causal_with_shorter_query_aligns_bottom_right():
  # The last T of S positions, as when decoding after S - T cached tokens.
  kv_len = 12
  q_full, k, v = make_qkv(4, q_len=kv_len, kv_len=kv_len)
  q = q_full[:, kv_len - T:]
  out = attention.causal_attention(q, k, v)
  explicit = np.tril(np.ones((T, kv_len), bool), k=kv_len - T)
  with_mask = attention.scaled_dot_product_attention(
      q, k, v, mask=jnp.asarray(explicit)[None, None])
  full = attention.causal_attention(q_full, k, v)
  np.testing.assert_allclose(out, with_mask, atol=1e-6)
  np.testing.assert_allclose(out, full[:, kv_len - T:], atol=1e-6)


def test_causal_with_longer_query_leaves_early_rows_empty():
  # T > S: queries i < T - S precede every key and attend nothing.
  q, _, _ = make_qkv(11, q_len=T)
  _, k, v = make_qkv(12, kv_len=3)
  out = attention.causal_attention(q, k, v)
  expected, _ = numpy_attention(q, k, v, causal=True)
  np.testing.assert_array_equal(out[:, :T - 3], 0.0)
  np.testing.assert_allclose(out, expected, atol=2e-6)
  grads = jax.grad(lambda q: jnp.sum(attention.causal_attention(q, k, v)))(q)
  assert np.isfinite(grads).all()


def test_fully_masked_rows_are_zero_with_finite_gradients():
  q, k, v = make_qkv(5)
  # Queries 0..2 of example 1 may attend nothing.
  mask = np.ones((B, 1, T, T), bool)
  mask[1, :, :3] = False
  mask = jnp.asarray(mask)

  def loss(q, k, v):
    return jnp.sum(attention.scaled_dot_product_attention(q, k, v, mask=mask))

  out = attention.scaled_dot_product_attention(q, k, v, mask=mask)
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_array_equal(out[1, :3], 0.0)
  assert np.abs(np.asarray(out[1, 3:])).sum() > 0
  assert all(np.isfinite(g).all() for g in grads)
  np.testing.assert_array_equal(grads[0][1, :3], 0.0)


def test_minus_infinity_bias_masks_like_a_mask():
  q, k, v = make_qkv(6)
  keep = np.asarray(padding())
  bias = jnp.where(jnp.asarray(keep), 0.0, -jnp.inf)
  np.testing.assert_allclose(
      attention.scaled_dot_product_attention(q, k, v, bias=bias),
      attention.scaled_dot_product_attention(q, k, v, mask=jnp.asarray(keep)),
      atol=1e-7)


def test_bfloat16_inputs_agree_with_float32_reference():
  q, k, v = make_qkv(7, num_kv_heads=2, dtype=jnp.bfloat16)
  out = attention.causal_attention(q, k, v)
  expected, _ = numpy_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                v.astype(jnp.float32), causal=True)
  assert out.dtype == jnp.bfloat16
  # bfloat16 keeps 8 significant bits: the probabilities are rounded to it
  # before they meet the values, and so is the output.
  np.testing.assert_allclose(out.astype(jnp.float32), expected, atol=3e-2,
                             rtol=3e-2)
  # The weights themselves come from float32 logits: products of bfloat16
  # values are exact in float32, so only summation rounding remains.
  _, expected_weights = numpy_attention(
      q.astype(jnp.float32), k.astype(jnp.float32), k.astype(jnp.float32),
      causal=True)
  np.testing.assert_allclose(attention.attention_weights(q, k, is_causal=True),
                             expected_weights, atol=1e-5)


def test_cross_attention_key_padding_mask_equals_explicit_mask():
  kv_len = 12
  q, k, v = make_qkv(8, kv_len=kv_len)
  key_padding_mask = np.arange(kv_len)[None, :] < np.array([[12], [4]])
  out = attention.cross_attention(q, k, v,
                                  key_padding_mask=jnp.asarray(key_padding_mask))
  expected, _ = numpy_attention(q, k, v, mask=key_padding_mask[:, None, None])
  np.testing.assert_allclose(out, expected, atol=2e-6)


def test_dropout_zeroes_or_rescales_each_weight():
  # With value = identity over keys, the output is the weights themselves.
  q, k, _ = make_qkv(9)
  value = jnp.broadcast_to(jnp.eye(T)[None, :, None, :], (B, T, N, T))
  q, k = q[..., :T], k[..., :T]
  weights = attention.attention_weights(q, k)
  dropped = attention.scaled_dot_product_attention(
      q, k, value, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  dropped_BxNxTxS = jnp.transpose(dropped, (0, 2, 1, 3))
  kept = np.isclose(dropped_BxNxTxS, 2 * weights, rtol=1e-5)
  zeroed = np.asarray(dropped_BxNxTxS) == 0
  assert np.all(kept | zeroed)
  assert 0.3 < kept.mean() < 0.7
  # Each weight is dropped on its own, not whole rows or columns.
  assert (kept & ~zeroed).any(-1).mean() > 0.9 and zeroed.any(-1).mean() > 0.9
  assert (kept & ~zeroed).any(-2).mean() > 0.9 and zeroed.any(-2).mean() > 0.9
  no_rng = attention.scaled_dot_product_attention(q, k, value,
                                                   dropout_rate=0.5)
  np.testing.assert_allclose(jnp.transpose(no_rng, (0, 2, 1, 3)), weights,
                             atol=1e-6)


def test_permuting_keys_and_values_together_changes_nothing():
  q, k, v = make_qkv(10)
  perm = np.random.default_rng(0).permutation(T)
  np.testing.assert_allclose(
      attention.scaled_dot_product_attention(q, k[:, perm], v[:, perm]),
      attention.scaled_dot_product_attention(q, k, v), atol=1e-6)


@pytest.mark.parametrize('shapes, kwargs, message', [
    (((B, T, N, H), (B, T, N, 8), (B, T, N, 8)), {}, 'head dim'),
    (((B, T, N, H), (B, T, 3, H), (B, T, 3, H)), {}, 'must divide'),
    (((B, T, N, H), (B, T, N, H), (B, 5, N, H)), {}, 'must be equal'),
    (((B, T, H), (B, T, N, H), (B, T, N, H)), {}, 'rank 4'),
    (((B, T, N, H),) * 3, {'mask': np.ones((T, T), bool)}, 'mask has shape'),
    (((B, T, N, H),) * 3, {'mask': np.ones((B, 1, T, 5), bool)},
     r'mask has shape \(2, 1, 8, 5\); it must be rank 4 and broadcastable'),
    (((B, T, N, H),) * 3, {'mask': np.ones((B, 1, T, T), np.int32)},
     'boolean'),
    (((B, T, N, H),) * 3, {'bias': np.zeros((B, T, T))}, 'bias has shape'),
    (((B, T, N, H),) * 3, {'dropout_rate': 1.0}, 'dropout_rate'),
])
def test_bad_arguments_raise_value_error(shapes, kwargs, message):
  q, k, v = (jnp.zeros(shape) for shape in shapes)
  with pytest.raises(ValueError, match=message):
    attention.scaled_dot_product_attention(q, k, v, **kwargs)


def test_registry_lists_dense_and_rejects_unknown_names():
  assert attention.get('dense') is attention.scaled_dot_product_attention
  assert 'dense' in attention.names()
  with pytest.raises(ValueError, match="unknown attention 'nope'"):
    attention.get('nope')


class TracedAndUntracedTest(chex.TestCase):
  """The dense core and chunked's XLA code, called as they are and under
  jit (chex.variants): a padding mask, packed rows' segment ids and
  ALiBi's position bias built inside the function give the float64
  reference's output, and a shape mismatch is refused as the function is
  traced, naming the argument."""

  @chex.variants(with_jit=True, without_jit=True)
  @pytest.mark.core
  def test_masks_and_biases_built_inside_equal_the_reference(self):
    q, k, v = make_qkv(30, num_kv_heads=2)
    lengths, ids = np.array([T, 5]), np.array([[1] * 3 + [2] * 5, [4] * T])
    positions_BxT = np.tile(np.arange(T), (B, 1))

    @self.variant
    def attend(q, k, v, lengths, ids, positions_BxT):
      padded = (jnp.arange(T)[None] < lengths[:, None])[:, None, None]
      bias = positions.alibi_bias(positions_BxT, positions_BxT, N)
      return [fn(q, k, v, bias, mask=mask, is_causal=True, **options)
              for mask in (padded, attention.SegmentMask(ids))
              for fn, options in (
                  (attention.scaled_dot_product_attention, {}),
                  (attention.get('chunked'), dict(chunk_size=4,
                                                  kernel='xla')))]

    index = np.arange(T)
    bias = np.asarray(positions.alibi_bias(positions_BxT, positions_BxT, N)
                      .at(index[:, None], index[None]))
    expected = [numpy_attention(q, k, v, bias, mask, causal=True)[0]
                for mask in (padding(), ids[:, None, :, None]
                             == ids[:, None, None, :])]
    chex.assert_trees_all_close(
        attend(q, k, v, lengths, ids, positions_BxT),
        [expected[0]] * 2 + [expected[1]] * 2, atol=2e-6, rtol=2e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_a_shape_mismatch_is_refused_naming_the_argument(self):
    q, k, v = make_qkv(31)
    attend = self.variant(attention.scaled_dot_product_attention)
    with self.assertRaisesRegex(
        ValueError, r'key shape \(2, 8, 4, 16\) and value shape '
        r'\(2, 5, 4, 16\) must be equal \[B, S, K, H\]'):
      attend(q, k, v[:, :5])
    with self.assertRaisesRegex(ValueError, r'mask has shape \(2, 8\)'):
      attend(q, k, v, mask=np.ones((B, T), bool))
