"""The knobs published architectures need, each against a hand-written
reference: normalisation epsilon, embedding scale and tied readout, models
without biases, partial rotary embeddings."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, build
from model import positions
from model.layers import Mlp, make_norm

CONFIG = ModelConfig(vocab_size=40, d_model=16, num_heads=2, num_layers=1,
                     mlp_dim=32, max_len=16, position='learned')
TOKENS_BxT = jnp.asarray(np.random.RandomState(0).randint(1, 40, (2, 8)))


@pytest.mark.parametrize('norm', ['layernorm', 'rmsnorm'])
def test_norm_epsilon(norm):
  config = dataclasses.replace(CONFIG, norm=norm, norm_epsilon=0.5)
  x = jnp.asarray(np.random.RandomState(1).normal(size=(3, 16)) * 0.3,
                  jnp.float32)
  layer = make_norm(config)
  params = layer.init(jax.random.key(0), x)
  x64 = np.asarray(x, np.float64)
  if norm == 'layernorm':
    centred = x64 - x64.mean(-1, keepdims=True)
    expected = centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + 0.5)
  else:
    expected = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 0.5)
  np.testing.assert_allclose(layer.apply(params, x), expected, rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize('scaled', [True, False])
def test_embedding_scale_and_tied_readout(scaled):
  """Embeddings drawn at embedding_init_stddev; the tied readout is
  h E^T, divided by sqrt(d_model) only with scale_tied_readout."""
  config = dataclasses.replace(CONFIG, vocab_size=512, d_model=64,
                               embedding_init_stddev=0.02,
                               scale_tied_readout=scaled)
  model = build(config)
  params = nn.unbox(model.init(jax.random.key(0), TOKENS_BxT)['params'])
  table = np.asarray(params['embedder']['token_embedding']['embedding'])
  assert abs(table.std() / 0.02 - 1) < 0.05
  readout, _ = model.apply({'params': params}, TOKENS_BxT, readout=True)
  expected = np.einsum('btd,vd->btv', np.asarray(readout.hidden_BxTxD),
                       table) / (8.0 if scaled else 1.0)
  np.testing.assert_allclose(readout.logits(), expected, rtol=1e-5,
                             atol=1e-6)


def test_no_biases():
  """use_bias=False: no bias anywhere but LayerNorm's, and a projection is
  x @ W."""
  config = dataclasses.replace(CONFIG, use_bias=False, tie_embeddings=False,
                               mlp_activation='swiglu')
  model = build(config)
  params = nn.unbox(model.init(jax.random.key(0), TOKENS_BxT)['params'])
  paths = [jax.tree_util.keystr(path)
           for path, _ in jax.tree_util.tree_leaves_with_path(params)]
  biased = [path for path in paths if 'bias' in path]
  assert biased and all('norm' in path for path in biased), biased
  mlp = params['decoder']['block_0']['mlp']
  x = np.random.RandomState(2).normal(size=(1, 4, 16)).astype(np.float32)
  silu = lambda z: z / (1 + np.exp(-z))
  expected = (silu(x @ mlp['wi_gate']['kernel']) * (x @ mlp['wi']['kernel'])
              ) @ mlp['wo']['kernel']
  np.testing.assert_allclose(Mlp(config).apply({'params': mlp}, x), expected,
                             rtol=1e-5, atol=1e-6)


def test_partial_rope():
  """rope_fraction: the first R = fraction * H channels rotate in pairs
  (i, i + R/2) at base^(-2i/R); the rest pass unchanged."""
  rng = np.random.RandomState(3)
  x = rng.normal(size=(1, 5, 2, 8)).astype(np.float32)
  pos = np.arange(5)[None]
  rotated = np.asarray(positions.rotate(jnp.asarray(x), jnp.asarray(pos),
                                        max_wavelength=500.0, fraction=0.5))
  expected = x.copy()
  for i in range(2):  # R = 4: pairs (0, 2) and (1, 3).
    angle = pos[0, :, None] * 500.0 ** (-2 * i / 4)
    a, b = x[0, :, :, i], x[0, :, :, i + 2]
    expected[0, :, :, i] = a * np.cos(angle) - b * np.sin(angle)
    expected[0, :, :, i + 2] = a * np.sin(angle) + b * np.cos(angle)
  np.testing.assert_allclose(rotated, expected, rtol=1e-5, atol=1e-6)
  assert ModelConfig(position='rope', rope_fraction=0.25).rope_fraction == 0.25
