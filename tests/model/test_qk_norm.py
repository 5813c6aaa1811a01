"""QK-norm against the attention layer written out by hand: projections,
each head's queries and keys normalised with their scales, rotated by
position, exact attention, the output projection."""

from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, positions
from model.layers import MultiHeadAttention

B, T, D = 2, 12, 32


def normalised(x, params, kind, epsilon=1e-6):
  """flax's RMSNorm or LayerNorm over the last dim, written out."""
  if kind == 'layernorm':
    x = x - x.mean(-1, keepdims=True)
    out = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + epsilon)
    return out * params['scale'] + params['bias']
  return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + epsilon) * (
      params['scale'])


def by_hand(params, config, x, positions_BxT):
  project = lambda name: (np.einsum('btd,dnh->btnh', x,
                                    params[name]['kernel'])
                          + params[name]['bias'])
  rotation = positions.SCHEMES['rope'].rotation(config)
  q, k = (positions.rotate(normalised(project(name), params[f'{name}_norm'],
                                      config.qk_norm),
                           positions_BxT, **rotation)
          for name in ('query', 'key'))
  out = jax.nn.dot_product_attention(q, k, project('value'), is_causal=True)
  return (np.einsum('btnh,nhd->btd', out, params['out']['kernel'])
          + params['out']['bias'])


@pytest.mark.parametrize('attention,kind', [('dense', 'rmsnorm'),
                                            ('chunked', 'layernorm')])
def test_qk_norm_equals_the_layer_written_out(attention, kind):
  """GQA (4 query heads, 2 key/value heads), RoPE, causal; the norms'
  scales (and biases) drawn at random, so each is seen to apply."""
  config = ModelConfig(d_model=D, num_heads=4, num_kv_heads=2,
                       position='rope', attention=attention, qk_norm=kind,
                       attention_options=(('chunk_size', 4),)
                       if attention == 'chunked' else ())
  layer = MultiHeadAttention(config, causal=True)
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  positions_BxT = jnp.tile(jnp.arange(T), (B, 1))
  call = dict(q_positions_BxT=positions_BxT, kv_positions_BxS=positions_BxT)
  # Only the shapes of the initial parameters: all of them are drawn.
  params = nn.meta.unbox(jax.eval_shape(layer.init, jax.random.key(1), x, x,
                                        **call))['params']
  params = jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)
  assert set(params['query_norm']) == (
      {'scale', 'bias'} if kind == 'layernorm' else {'scale'})
  out, _, _ = layer.apply({'params': params}, x, x, **call)
  np.testing.assert_allclose(out, by_hand(params, config, x, positions_BxT),
                             atol=2e-5, rtol=2e-5)
