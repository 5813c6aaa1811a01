"""References written out by hand for the model's layer tests: parameters
drawn at random, and a causal attention layer with RoPE (its projections,
rotation, attention and output) composed from jax.nn's attention."""

from flax import linen as nn
import jax
import numpy as np

from model import positions


def drawn(params, scale: float):
  """Every parameter drawn at random (times `scale`), so that each is seen
  to apply."""
  leaves, structure = jax.tree.flatten(nn.meta.unbox(params))
  keys = jax.random.split(jax.random.key(7), len(leaves))
  return structure.unflatten([scale * jax.random.normal(key, leaf.shape)
                              for key, leaf in zip(keys, leaves)])


def project(x_BxTxD, params):
  """A head projection, [B, T, D] -> [B, T, N, H]."""
  return (np.einsum('btd,dnh->btnh', x_BxTxD, params['kernel'])
          + params['bias'])


def rope_attention(config, params, x_BxTxD, values_BxTxKxH, positions_BxT):
  """MultiHeadAttention's output, causal with RoPE, its values given:
  queries and keys projected from x and rotated, attended, projected out."""
  rotation = positions.SCHEMES['rope'].rotation(config)
  rotated = lambda name: positions.rotate(
      project(x_BxTxD, params[name]), positions_BxT, **rotation)
  attended = jax.nn.dot_product_attention(
      rotated('query'), rotated('key'), values_BxTxKxH, is_causal=True)
  return (np.einsum('btnh,nhd->btd', attended, params['out']['kernel'])
          + params['out']['bias'])
