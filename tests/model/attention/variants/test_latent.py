"""Latent attention (model/attention/variants/latent.py): the layer equals
DeepSeek-V2's formulation written in float64; decoding's attention over cached
latents equals attention over the keys and values they make; the cache
holds C + R numbers a position. Cached decoding equal to the full pass:
tests/train/decode/test_decoding.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, families, positions
from model.attention import core
from model.attention.variants import latent
from model.layers import MultiHeadAttention
from model.state import Cache, LatentCache

B, T, D, N, K, H = 2, 7, 16, 4, 2, 4
C, Q, R = 6, 5, 2  # The latents' widths; the rope part, half a head.


def config_of(**overrides) -> ModelConfig:
  return ModelConfig(**dict(
      family='decoder_lm', vocab_size=16, d_model=D, num_heads=N,
      num_kv_heads=K, num_layers=1, mlp_dim=32, max_len=T, position='rope',
      rope_fraction=R / H, attention='mla',
      attention_options={'kv_rank': C, 'q_rank': Q}) | overrides)


def rotated(x, positions_BxT, width):
  """The first `width` channels of x [B, T, n, H] rotated as rope does:
  pairs (i, i + width / 2) by position * 10000^(-2i / width)."""
  half = width // 2
  angles = (positions_BxT[:, :, None, None]
            * 10_000.0 ** (-np.arange(half) / half))
  first, second = x[..., :half], x[..., half:width]
  return np.concatenate([first * np.cos(angles) - second * np.sin(angles),
                         first * np.sin(angles) + second * np.cos(angles),
                         x[..., width:]], axis=-1)


def test_the_layer_equals_its_formulation_in_float64():
  config = config_of()
  layer = MultiHeadAttention(config, causal=True)
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  positions = jnp.tile(jnp.arange(T) + 3, (B, 1))
  params = jax.jit(layer.init)(jax.random.key(1), x, x,
                               q_positions_BxT=positions,
                               kv_positions_BxS=positions)
  out, _, _ = jax.jit(layer.apply)(params, x, x, q_positions_BxT=positions,
                                   kv_positions_BxS=positions)

  p = jax.tree.map(lambda a: np.asarray(a, np.float64),
                   nn.unbox(params['params']))
  w = p['latent']
  x64, pos = np.asarray(x, np.float64), np.asarray(positions, np.float64)

  def rms(a, gain):
    return a / np.sqrt(np.mean(a * a, -1, keepdims=True) + 1e-6) * gain

  c = rms(x64 @ w['kv_down'], w['kv_gain'])  # [B, T, C]
  q = np.einsum('btq,qnh->btnh', rms(x64 @ w['q_down'], w['q_gain']),
                w['q_up'])
  rope_key = np.broadcast_to((x64 @ w['rope_key'])[:, :, None], (B, T, K, R))
  k = np.concatenate([rope_key, np.einsum('btc,ckh->btkh', c, w['key_up'])],
                     -1)
  v = np.einsum('btc,ckh->btkh', c, w['value_up'])
  q, k = rotated(q, pos, R), rotated(k, pos, R)
  k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
  logits = np.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(H)
  logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  heads = np.einsum('bnts,bsnh->btnh', weights, v)
  want = (np.einsum('btnh,nhd->btd', heads, p['out']['kernel'])
          + p['out']['bias'])
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('logit_cap', [0.0, 2.0])
def test_attending_over_latents_equals_attending_over_their_keys_and_values(
    logit_cap):
  """attend_cached never forms a key or a value; what it gives is exact
  attention over those the latents make (grouped heads, a mask with
  holes; capped logits, with attention sinks, against the core's)."""
  config = config_of()
  projections = latent.projections(config, R, kv_rank=C, q_rank=Q)
  x = jax.random.normal(jax.random.key(2), (B, T, D))
  params = projections.init(jax.random.key(3), x,
                            method=latent.LatentProjections.queries)
  at = jnp.tile(jnp.arange(T), (B, 1))
  mask = jax.random.bernoulli(jax.random.key(4), 0.7, (B, 1, T, T))
  mask = mask.at[..., 0].set(True)

  def both(module):
    q = positions.rotate(module.queries(x), at, fraction=R / H)
    compressed, rope = module.compress(x)
    rope = positions.rotate(rope[:, :, None], at)[:, :, 0]
    key, value = module.keys_values(compressed, rope)
    sinks = jnp.linspace(-1.0, 2.0, q.shape[2]) if logit_cap else None
    got = module.attend_cached(q, compressed, rope, mask,
                               logit_cap=logit_cap, sinks=sinks)
    if logit_cap:
      return got, core.scaled_dot_product_attention(
          q, key, value, mask=mask, logit_cap=logit_cap, sinks=sinks)
    return got, jax.nn.dot_product_attention(q, key, value, mask=mask)

  got, want = projections.apply(params, method=both)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_the_cache_holds_a_latent_and_a_rope_part_a_position():
  cache = Cache.empty(config_of(num_layers=2), B, T).self_attention
  assert [type(layer) for layer in cache] == [LatentCache] * 2
  assert cache[0].latent.shape == (B, T, C)
  assert cache[0].rope.shape == (B, T, R)  # C + R = 8 where K, V hold 16.
  default = Cache.empty(config_of(attention_options={}), B, T)
  assert default.self_attention[0].latent.shape == (B, T, D // 4)


@pytest.mark.parametrize('overrides, key', [
    (dict(qk_norm='rmsnorm'), 'qk_norm'),
    (dict(value_residual=True, num_layers=2), 'value_residual'),
    (dict(value_embeddings=1), 'value_embeddings'),
    (dict(rope_fraction=1.0), 'rope_fraction'),
    (dict(attention_projections=False), 'attention_projections')])
def test_what_latent_attention_cannot_honour_is_refused_by_name(overrides,
                                                               key):
  with pytest.raises(ValueError, match=f'config.model.{key}'):
    families.check(config_of(**overrides))
