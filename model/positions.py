"""Absolute position information added to token embeddings."""

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def sinusoidal(positions_BxT: Array, d_model: int,
               max_timescale: float = 1e4) -> Array:
  """Sinusoidal encodings (Vaswani et al. 2017), float32 [B, T, d_model].

  Channel 2i is sin(p / max_timescale^(2i/d)), channel 2i+1 the cosine of the
  same angle; an odd d_model gets a zero last channel.
  """
  num_frequencies = d_model // 2
  exponents = jnp.arange(num_frequencies, dtype=jnp.float32) * 2.0 / d_model
  frequencies_F = max_timescale ** -exponents
  angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * frequencies_F
  encoding = jnp.stack([jnp.sin(angles_BxTxF), jnp.cos(angles_BxTxF)], axis=-1)
  encoding_BxTxD = encoding.reshape(*positions_BxT.shape, 2 * num_frequencies)
  return jnp.pad(encoding_BxTxD,
                 [(0, 0)] * positions_BxT.ndim + [(0, d_model % 2)])


class LearnedPositions(nn.Module):
  """A learned [max_len, d_model] table, looked up by position; a position
  outside [0, max_len) gives NaN."""

  max_len: int
  d_model: int
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, positions_BxT: Array) -> Array:
    table = self.param(
        'embedding',
        nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02),
                                     (None, 'embed')),
        (self.max_len, self.d_model), self.param_dtype)
    # Positions are traced values, so a position >= max_len cannot raise an
    # error here; it reads NaN, which the loss makes impossible to miss.
    return jnp.take(table, positions_BxT, axis=0, mode='fill',
                    fill_value=jnp.nan)
