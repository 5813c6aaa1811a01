"""`linformer`: keys and values projected along the length to a fixed rank
(Wang et al. 2020), so attention costs O(T * rank).

The projections are parameters (`parameters`, which `MultiHeadAttention`
calls in its scope) that the model passes in. Padded keys are zeroed
before projecting, so padding never leaks into the projected keys. The
projection mixes all positions, so causal attention is impossible.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention import core

Array = jax.Array


def linformer_attention(query: Array, key: Array, value: Array,
                        bias: Array | None = None, mask: Array | None = None,
                        *, scale: float | None = None, is_causal: bool = False,
                        key_projection: Array, value_projection: Array,
                        sinks: Array | None = None) -> Array:
  """Dense attention over E key and F value, E and F [rank, >= S].

  Args:
    key_projection: E, whose first S columns project the S keys.
    value_projection: F, likewise for the values.
    sinks: as dense's.
  """
  core.check_inputs(query, key, value, bias, mask)
  if is_causal:
    raise ValueError('linformer attention cannot be causal: its projection '
                     'mixes every position into every projected key.')
  if bias is not None:
    raise ValueError('linformer attention cannot add a bias over the keys it '
                     'projects away.')
  kv_len = key.shape[1]
  for name, projection in (('key_projection', key_projection),
                           ('value_projection', value_projection)):
    if projection.ndim != 2 or projection.shape[1] < kv_len:
      raise ValueError(f'{name} has shape {projection.shape}; it must be '
                       f'[rank, >= {kv_len}] for {kv_len} keys.')
  if mask is not None:
    if mask.shape[1] != 1 or mask.shape[2] != 1:
      raise ValueError(
          'linformer attention honours key padding masks only (shape '
          f'[B, 1, 1, S]), not a mask of shape {mask.shape}.')
    keep = mask[:, 0, 0, :, None, None].astype(key.dtype)  # [B?, S, 1, 1]
    key, value = key * keep, value * keep
  e = key_projection[:, :kv_len].astype(key.dtype)
  f = value_projection[:, :kv_len].astype(value.dtype)
  projected_key = jnp.einsum('rs,bskh->brkh', e, key)
  projected_value = jnp.einsum('rs,bskh->brkh', f, value)
  return core.scaled_dot_product_attention(query, projected_key,
                                           projected_value, scale=scale,
                                           sinks=sinks)


def parameters(module: nn.Module, config, *, rank: int = 64,
               **options) -> dict[str, Any]:
  """E and F [rank, max_len], Gaussian with variance 1 / rank, created in
  `module` for a layer of `config` (a ModelConfig); with the other
  `options`, the keyword arguments of linformer_attention."""
  init = nn.with_logical_partitioning(
      nn.initializers.normal(stddev=rank ** -0.5), (None, 'length'))
  return options | {
      'key_projection': module.param('linformer_key', init,
                                     (rank, config.max_len),
                                     config.weight_dtype),
      'value_projection': module.param('linformer_value', init,
                                       (rank, config.max_len),
                                       config.weight_dtype)}
