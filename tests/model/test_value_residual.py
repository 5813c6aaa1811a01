"""Value residual learning (config.model.value_residual): a mixing layer
against the attention layer written out by hand, and a stack against its
blocks composed by hand around the first block's values."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from model import ModelConfig
from model.blocks import BlockInputs, TransformerBlock, TransformerStack
from model.layers import MultiHeadAttention
from tests.helpers.written_out import drawn, project, rope_attention

B, T, D = 2, 12, 32
CONFIG = ModelConfig(d_model=D, num_heads=4, num_kv_heads=2, num_layers=3,
                     mlp_dim=64, position='rope', value_residual=True)
POSITIONS_BxT = jnp.tile(jnp.arange(T), (B, 1))
X_BxTxD = jax.random.normal(jax.random.key(0), (B, T, D))


def layernorm(x, params, epsilon=1e-6):
  """flax's LayerNorm over the last dim, written out."""
  x = x - x.mean(-1, keepdims=True)
  return (x / np.sqrt((x ** 2).mean(-1, keepdims=True) + epsilon)
          * params['scale'] + params['bias'])


def test_a_mixing_layer_attends_with_its_values_mixed_with_the_first_layers():
  """GQA, RoPE, causal: a * (x W_v + b_v) + b * v_first replaces the
  values, and is what the layer hands on."""
  layer = MultiHeadAttention(CONFIG, causal=True, mixes_values=True)
  first_BxTxKxH = jax.random.normal(jax.random.key(1), (B, T, 2, D // 4))
  call = dict(q_positions_BxT=POSITIONS_BxT, kv_positions_BxS=POSITIONS_BxT,
              first_values_BxSxKxH=first_BxTxKxH)
  params = drawn(layer.init(jax.random.key(2), X_BxTxD, X_BxTxD,
                            **call)['params'], 0.25)
  out, _, values = layer.apply({'params': params}, X_BxTxD, X_BxTxD, **call)

  a, b = params['value_mix']
  want_values = a * project(X_BxTxD, params['value']) + b * first_BxTxKxH
  want = rope_attention(CONFIG, params, X_BxTxD, want_values, POSITIONS_BxT)
  np.testing.assert_allclose(values, want_values, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


def test_every_later_block_mixes_in_the_first_blocks_values():
  """Three blocks: the first's values (its normalised input projected)
  reach the second and the third; with (a, b) = (1, 0) the stack is the
  one without value residuals."""
  stack = TransformerStack(CONFIG, causal=True, cross=False)
  inputs = BlockInputs(POSITIONS_BxT)
  params = drawn(stack.init(jax.random.key(3), X_BxTxD, inputs)['params'],
                0.25)
  assert 'value_mix' not in params['block_0']['self_attention']
  got, _ = stack.apply({'params': params}, X_BxTxD, inputs)

  first_BxTxKxH = project(
      layernorm(X_BxTxD, params['block_0']['self_attention_norm']),
      params['block_0']['self_attention']['value'])
  x_BxTxD = X_BxTxD
  for layer in range(3):
    block = TransformerBlock(CONFIG, True, False, mixes_values=layer > 0)
    x_BxTxD = block.apply({'params': params[f'block_{layer}']}, x_BxTxD,
                          inputs, first_values_BxSxKxH=first_BxTxKxH)[0]
  want = layernorm(x_BxTxD, params['final_norm'])
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

  unmixed = jax.tree_util.tree_map_with_path(
      lambda path, p: (jnp.array([1.0, 0.0]) if 'value_mix' in str(path)
                       else p), params)
  without = TransformerStack(dataclasses.replace(CONFIG, value_residual=False),
                             causal=True, cross=False)
  plain = {name: ({**block, 'self_attention': {
      key: value for key, value in block['self_attention'].items()
      if key != 'value_mix'}} if name.startswith('block_') else block)
           for name, block in unmixed.items()}
  np.testing.assert_allclose(
      stack.apply({'params': unmixed}, X_BxTxD, inputs)[0],
      without.apply({'params': plain}, X_BxTxD, inputs)[0], atol=1e-6,
      rtol=1e-6)
