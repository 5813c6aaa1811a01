"""The speedrun's architecture options (config.model.smear,
value_embeddings, unet_skips): each against its formula written out by
hand, at its initial parameters and at drawn ones."""

import dataclasses

from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, build
from model.blocks import BlockInputs, TransformerBlock, TransformerStack
from model.embedding_extras import SMEAR_GATE_WIDTH, Smear
from model.layers import MultiHeadAttention
from tests.helpers.written_out import drawn, project, rope_attention

B, T, D, V = 2, 8, 16, 32
CONFIG = ModelConfig(family='decoder_lm', vocab_size=V, d_model=D,
                     num_heads=2, num_layers=4, mlp_dim=32, max_len=T,
                     position='rope')
X_BxTxD = jax.random.normal(jax.random.key(0), (B, T, D))
POSITIONS_BxT = jnp.tile(jnp.arange(T), (B, 1))
# Row 1 packs two documents: the second starts at column 5.
PACKED_BxT = jnp.asarray([list(range(T)), [0, 1, 2, 3, 4, 0, 1, 2]])


def smear_reference(x, positions, gate, gain):
  """x_t + gain * sigmoid(gate . x_t[:12]) * x_{t-1} where t continues a
  document (its position is not 0 and it is not a row's first column)."""
  x = np.asarray(x, np.float64)
  out = x.copy()
  for b in range(x.shape[0]):
    for t in range(1, x.shape[1]):
      if positions[b, t] > 0:
        g = gain[0] / (1 + np.exp(-x[b, t, :SMEAR_GATE_WIDTH] @ gate))
        out[b, t] += g * x[b, t - 1]
  return out


def test_smear_starts_as_the_identity_and_mixes_within_a_document():
  smear = Smear(CONFIG)
  params = smear.init(jax.random.key(1), X_BxTxD, PACKED_BxT)['params']
  start, _ = smear.apply({'params': params}, X_BxTxD, PACKED_BxT)
  np.testing.assert_array_equal(start, X_BxTxD)  # gain and gate at zero.
  params = drawn(params, 0.5)
  got, _ = smear.apply({'params': params}, X_BxTxD, PACKED_BxT)
  want = smear_reference(X_BxTxD, np.asarray(PACKED_BxT),
                         np.asarray(params['gate']),
                         np.asarray(params['gain']))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # The first token of the second document is left alone.
  np.testing.assert_array_equal(got[1, 5], X_BxTxD[1, 5])


def test_a_smeared_decoder_sees_no_later_token():
  """The gradient of the logits at t with respect to the embeddings after
  t is exactly zero; those at t and t - 1 reach them."""
  config = dataclasses.replace(CONFIG, smear=True)
  model = build(config)
  tokens = jax.random.randint(jax.random.key(2), (1, T), 1, V)
  params = drawn(jax.jit(model.init)(jax.random.key(3), tokens)['params'],
                 0.5)

  def logits_by_position(perturbation):  # [T]
    logits, _ = model.apply({'params': params, 'perturbations': {
        'embeddings': perturbation}}, tokens)
    return logits[0].sum(-1)

  jacobian_TxT = np.abs(jax.jit(jax.jacrev(logits_by_position))(
      jnp.zeros((1, T, D)))[:, 0]).sum(-1)
  assert np.all(np.triu(jacobian_TxT, 1) == 0)
  assert np.all(np.diag(jacobian_TxT) != 0)
  assert np.all(np.diag(jacobian_TxT, -1) != 0)


@pytest.mark.parametrize('tables, layers', [
    (1, [0, None, None, 0]), (2, [0, 1, 0, 1])])
def test_value_embedding_tables_serve_a_first_and_a_last_layer(tables,
                                                               layers):
  config = dataclasses.replace(CONFIG, value_embeddings=tables)
  assert [config.value_embedding_table(i) for i in range(4)] == layers


def test_a_layer_adds_its_gated_value_embedding_to_its_values():
  """GQA, RoPE, causal: x W_v + b_v + g * ve replaces the values; g is
  0.5 at first."""
  config = ModelConfig(d_model=D, num_heads=4, num_kv_heads=2,
                       position='rope')
  layer = MultiHeadAttention(config, causal=True, adds_value_embedding=True)
  ve_BxTxKxH = jax.random.normal(jax.random.key(4), (B, T, 2, D // 4))
  call = dict(q_positions_BxT=POSITIONS_BxT, kv_positions_BxS=POSITIONS_BxT,
              value_embedding_BxSxKxH=ve_BxTxKxH)
  params = nn.meta.unbox(layer.init(jax.random.key(5), X_BxTxD, X_BxTxD,
                                    **call)['params'])
  assert params['value_embedding_gate'].tolist() == [0.5]
  out, _, values = layer.apply({'params': params}, X_BxTxD, X_BxTxD, **call)

  want_values = project(X_BxTxD, params['value']) + 0.5 * ve_BxTxKxH
  want = rope_attention(config, params, X_BxTxD, want_values, POSITIONS_BxT)
  np.testing.assert_allclose(values, want_values, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_a_decoder_with_value_embeddings_is_its_blocks_fed_its_tables():
  """Two tables on four layers: table i's rows of the tokens reach layers
  i and 2 + i, nothing else changes."""
  config = dataclasses.replace(CONFIG, value_embeddings=2)
  model = build(config)
  tokens = jax.random.randint(jax.random.key(6), (B, T), 1, V)
  params = drawn(model.init(jax.random.key(8), tokens)['params'], 0.5)
  got, _ = model.apply({'params': params}, tokens)
  x = params['embedder']['token_embedding']['embedding'][tokens]
  inputs = BlockInputs(POSITIONS_BxT)
  for layer in range(4):
    table = params['value_embeddings'][f'table_{layer % 2}']
    block = TransformerBlock(config, True, False, adds_value_embedding=True)
    x = block.apply({'params': params['decoder'][f'block_{layer}']}, x,
                    inputs, value_embedding_BxTxKxH=table[tokens])[0]
  x = nn.LayerNorm(epsilon=config.norm_epsilon).apply(
      {'params': params['decoder']['final_norm']}, x)
  want = x @ params['embedder']['token_embedding']['embedding'].T / np.sqrt(D)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_unet_skips_add_the_first_halfs_outputs_to_the_second_halfs_inputs():
  """Four blocks: block 2 reads block 1's output times w[1], block 3
  block 0's times w[0]; the weights start at 1 and each has a gradient."""
  config = dataclasses.replace(CONFIG, unet_skips=True)
  stack = TransformerStack(config, causal=True, cross=False)
  inputs = BlockInputs(POSITIONS_BxT)
  params = jax.jit(stack.init)(jax.random.key(9), X_BxTxD, inputs)['params']
  assert nn.meta.unbox(params)['unet_weights'].tolist() == [1.0, 1.0]
  params = drawn(params, 0.5)
  got, _ = jax.jit(stack.apply)({'params': params}, X_BxTxD, inputs)
  block = jax.jit(TransformerBlock(config, True, False).apply)
  outputs, x = [], X_BxTxD
  for layer in range(4):
    if layer >= 2:
      x = x + params['unet_weights'][3 - layer] * outputs[3 - layer]
    x = block({'params': params[f'block_{layer}']}, x, inputs)[0]
    outputs.append(x)
  want = nn.LayerNorm(epsilon=config.norm_epsilon).apply(
      {'params': params['final_norm']}, x)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

  def loss(weights):
    out, _ = stack.apply({'params': params | {'unet_weights': weights}},
                         X_BxTxD, inputs)
    return (out ** 2).sum()
  assert np.all(jax.jit(jax.grad(loss))(params['unet_weights']) != 0)
