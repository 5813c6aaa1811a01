"""Position schemes: each relative one depends on offsets only, as it
claims; randomized positions are drawn and shared as they claim."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import DecoderLM, EncoderDecoder, ModelConfig
from model import families, positions
from model.families import encoder_decoder as encoder_decoder_lib
from model.layers import MultiHeadAttention

B, T, N, H = 2, 8, 4, 8


@pytest.mark.core
def test_rope_scores_depend_only_on_the_offset():
  q = jax.random.normal(jax.random.key(0), (B, T, N, H))
  k = jax.random.normal(jax.random.key(1), (B, T, N, H))
  base = jnp.tile(jnp.arange(T), (B, 1))

  def scores(shift):
    rq = positions.rotate(q, base + shift)
    rk = positions.rotate(k, base + shift)
    return jnp.einsum('btnh,bsnh->bnts', rq, rk)

  np.testing.assert_allclose(scores(0), scores(37), atol=1e-4)
  assert not np.allclose(scores(0), jnp.einsum('btnh,bsnh->bnts', q, k),
                         atol=1e-3)
  np.testing.assert_allclose(jnp.linalg.norm(positions.rotate(q, base), axis=-1),
                             jnp.linalg.norm(q, axis=-1), rtol=1e-5)


@pytest.mark.core
def test_alibi_slopes_follow_the_paper():
  np.testing.assert_allclose(positions.alibi_slopes(8),
                             [2.0 ** -(i + 1) for i in range(8)])
  # Six heads: the four slopes of 4 heads, then every other slope of 8.
  np.testing.assert_allclose(positions.alibi_slopes(6),
                             [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])


def full(bias, q_len=T, kv_len=T):
  """A PositionBias at every (query, key) pair: [B, N, T, S]."""
  return bias.at(np.arange(q_len)[:, None], np.arange(kv_len)[None, :])


def test_alibi_bias_depends_only_on_the_offset():
  base = jnp.tile(jnp.arange(T), (B, 1))
  bias = full(positions.alibi_bias(base, base, N))
  np.testing.assert_allclose(
      bias, full(positions.alibi_bias(base + 11, base + 11, N)))
  # Four heads: the first slope is 2^(-8/4).
  np.testing.assert_allclose(bias[0, 0], -0.25 * np.abs(
      np.arange(T)[:, None] - np.arange(T)[None, :]))


def test_position_biases_read_any_pairs_as_the_full_bias_does():
  """At index arrays of any broadcast shape, as the block-sparse and
  chunked variants ask, a PositionBias equals the full bias there."""
  base = jnp.tile(jnp.arange(T), (B, 1)) + 3
  q = jax.random.normal(jax.random.key(0), (B, T, N, H))
  t5 = positions.T5Bias(N, 8, 16, bidirectional=True)
  shaw = positions.ShawRelative(H, 3)
  biases = [positions.alibi_bias(base, base, N),
            t5.apply(t5.init(jax.random.key(1), base, base), base, base),
            shaw.apply(shaw.init(jax.random.key(2), q, base, base, 0.5), q,
                       base, base, 0.5)]
  q_index = np.array([[[1], [4]], [[7], [0]]])  # [G=2, gq=2, 1]
  k_index = np.array([[[2, 5, 6]], [[0, 3, 7]]])  # [G=2, 1, gk=3]
  for bias in biases:
    expected = full(bias)[:, :, q_index, k_index]
    np.testing.assert_allclose(bias.at(q_index, k_index), expected)


def t5_bucket_reference(relative, bidirectional, num_buckets, max_distance):
  """The bucketing of Raffel et al. (2020), one scalar at a time."""
  bucket = 0
  if bidirectional:
    num_buckets //= 2
    if relative > 0:
      bucket += num_buckets
    distance = abs(relative)
  else:
    distance = max(-relative, 0)
  exact = num_buckets // 2
  if distance < exact:
    return bucket + distance
  large = exact + int(math.log(distance / exact) / math.log(max_distance / exact)
                      * (num_buckets - exact))
  return bucket + min(large, num_buckets - 1)


@pytest.mark.core
@pytest.mark.parametrize('bidirectional', [True, False])
def test_t5_buckets_match_the_reference(bidirectional):
  relative = np.arange(-300, 301)
  got = positions.t5_buckets(jnp.asarray(relative), bidirectional=bidirectional,
                             num_buckets=32, max_distance=128)
  expected = [t5_bucket_reference(int(r), bidirectional, 32, 128)
              for r in relative]
  np.testing.assert_array_equal(got, expected)


def test_shaw_relative_bias_is_query_dot_clipped_distance_embedding():
  module = positions.ShawRelative(head_dim=H, max_distance=2)
  q = jax.random.normal(jax.random.key(0), (1, T, N, H))
  pos = jnp.arange(T)[None]
  variables = module.init(jax.random.key(1), q, pos, pos, scale=0.5)
  table = np.asarray(jax.tree.leaves(variables)[0])
  bias = full(module.apply(variables, q, pos, pos, scale=0.5))
  for i in range(T):
    for j in range(T):
      row = table[np.clip(j - i, -2, 2) + 2]
      np.testing.assert_allclose(bias[0, :, i, j],
                                 0.5 * np.asarray(q[0, i]) @ row, atol=1e-5)


def test_deberta_terms_match_the_paper_written_out():
  """He et al. (2021), eq. 4: A_ij = (Qc_i Kc_j + Qc_i Kr_d(i,j) +
  Kc_j Qr_d(j,i)) / sqrt(3H), d the distance clipped to [-k, k - 1] plus k;
  here by loops over i and j, from the layer's own parameters."""
  d_model, k = 16, 3
  config = ModelConfig(vocab_size=32, d_model=d_model, num_heads=2,
                       num_kv_heads=1, position='deberta',
                       relative_max_distance=k)
  layer = MultiHeadAttention(config)
  x = jax.random.normal(jax.random.key(0), (1, T, d_model))
  pos = jnp.arange(T)[None] + 5
  apply = lambda params, **kw: layer.apply(
      params, x, x, q_positions_BxT=pos, kv_positions_BxS=pos, **kw)
  params = layer.init(jax.random.key(1), x, x, q_positions_BxT=pos,
                      kv_positions_BxS=pos)
  _, state = apply(params, mutable=['intermediates'])
  weights = state['intermediates']['attention_weights'][0]
  p = jax.tree.map(np.asarray, nn.meta.unbox(params['params']))
  project = lambda name, y: (np.einsum('td,dnh->tnh', y, p[name]['kernel'])
                             + p[name]['bias'])
  qc, kc = project('query', x[0]), project('key', x[0])  # [T, 2, 8], [T, 1, 8]
  table = p['disentangled']['embedding']
  kr = np.einsum('rd,dnh->rnh', table, p['disentangled']['key_position'])
  qr = np.einsum('rd,dnh->rnh', table, p['disentangled']['query_position'])
  delta = lambda i, j: np.clip(i - j, -k, k - 1) + k
  logits = np.zeros((2, T, T))
  for n in range(2):
    for i in range(T):
      for j in range(T):
        logits[n, i, j] = (qc[i, n] @ kc[j, 0] + qc[i, n] @ kr[delta(i, j), n]
                           + kc[j, 0] @ qr[delta(j, i), n]) / math.sqrt(3 * 8)
  np.testing.assert_allclose(weights[0], jax.nn.softmax(logits, axis=-1),
                             atol=1e-5)


def test_deberta_bias_depends_only_on_the_offset():
  module = positions.DisentangledBias(N, H, max_distance=3)
  q = jax.random.normal(jax.random.key(0), (B, T, N, H))
  k = jax.random.normal(jax.random.key(1), (B, T, 2, H))
  base = jnp.tile(jnp.arange(T), (B, 1))
  variables = module.init(jax.random.key(2), q, k, base, base, 16, 0.1)
  bias = lambda at: full(module.apply(variables, q, k, at, at, 16, 0.1))
  np.testing.assert_allclose(bias(base), bias(base + 21), atol=1e-6)
  assert not np.allclose(bias(base), bias(base * 2), atol=1e-3)


@pytest.mark.parametrize('position, relative', [
    ('rope', True), ('alibi', True), ('t5_bias', True), ('relative', True),
    ('deberta', True),
    ('sinusoidal', False), ('learned', False)])
def test_decoder_lm_with_relative_positions_ignores_a_shift(position,
                                                            relative):
  config = ModelConfig(vocab_size=32, d_model=32, num_heads=N, num_layers=1,
                       mlp_dim=32, max_len=64, position=position)
  model = DecoderLM(config)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 32, (B, T)))
  base = jnp.tile(jnp.arange(T), (B, 1))
  params = {'params': model.init(jax.random.key(0), tokens)['params']}
  shifted, _ = model.apply(params, tokens, base + 13)
  assert np.allclose(model.apply(params, tokens, base)[0], shifted,
                     atol=1e-4) == relative


def test_random_positions_are_an_increasing_uniform_draw():
  """Distinct, increasing, in range; each position drawn with probability
  length / max_positions (4000 rows: within 5 standard deviations)."""
  rows = np.asarray(positions.random_positions(jax.random.key(0), 4000, 6,
                                               24))
  assert rows.shape == (4000, 6) and rows.dtype == np.int32
  assert (np.diff(rows, axis=1) > 0).all()
  assert rows.min() >= 0 and rows.max() < 24
  counts = np.bincount(rows.ravel(), minlength=24)
  p = 6 / 24
  assert np.abs(counts - 4000 * p).max() < 5 * math.sqrt(4000 * p * (1 - p))
  # A range as long as the sequence leaves one draw: 0..T-1.
  np.testing.assert_array_equal(
      positions.random_positions(jax.random.key(1), 3, 5, 5),
      np.tile(np.arange(5), (3, 1)))


def encoder_decoder(position: str, max_len: int):
  config = ModelConfig(family='encoder_decoder', vocab_size=32, d_model=32,
                       num_heads=N, num_layers=1, mlp_dim=32, max_len=max_len,
                       position=position)
  return EncoderDecoder(config)


def test_random_sinusoidal_draws_one_set_of_positions_for_source_and_target(
    monkeypatch):
  """In training the source and target read the same drawn positions, the
  first S and T of them; evaluation reads 0..T-1, as sinusoidal does."""
  rng = np.random.default_rng(0)
  inputs = jnp.asarray(rng.integers(1, 32, (B, T)))
  targets = jnp.asarray(rng.integers(1, 32, (B, T - 3)))
  model = encoder_decoder('random_sinusoidal', max_len=64)
  params = {'params': model.init(jax.random.key(0), inputs,
                                 targets)['params']}
  evaluated, _ = model.apply(params, inputs, targets)
  sinusoidal, _ = encoder_decoder('sinusoidal', 64).apply(params, inputs,
                                                          targets)
  np.testing.assert_array_equal(evaluated, sinusoidal)

  drawn = jnp.asarray(np.sort(rng.choice(64, (B, T), replace=False)))
  monkeypatch.setattr(encoder_decoder_lib, 'random_positions',
                      lambda key, batch, length, limit: drawn[:, :length])
  trained, _ = model.apply(params, inputs, targets, deterministic=False,
                           rngs={'dropout': jax.random.key(1)})
  by_hand, _ = model.apply(
      params, inputs, targets, method=lambda m, s, t: m.decode(
          m.encode(s, drawn), s, t, drawn[:, :T - 3]))
  np.testing.assert_allclose(trained, by_hand, atol=1e-6)
  assert not np.allclose(trained, evaluated, atol=1e-3)


def test_only_a_family_that_draws_positions_takes_a_randomized_scheme():
  with pytest.raises(ValueError, match="config.model.position="
                     "'random_sinusoidal' draws random positions in training, "
                     "which config.model.family='encoder_decoder' does, not "
                     "'decoder_lm'"):
    families.check(ModelConfig(position='random_sinusoidal'))
