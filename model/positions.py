"""Position information: absolute encodings added to the token embeddings,
and relative ones applied inside self-attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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


# --- Relative positions, applied inside self-attention. ---


def rotate(x_BxTxNxH: Array, positions_BxT: Array,
           max_wavelength: float = 10_000.0) -> Array:
  """Rotary position embedding (Su et al. 2021).

  Channel pairs (i, i + H/2) rotate by the angle position * max_wavelength
  ^ (-2i / H), so the dot product of a rotated query and key depends on
  their positions only through the difference.
  """
  half = x_BxTxNxH.shape[-1] // 2
  frequencies_F = max_wavelength ** (-jnp.arange(half, dtype=jnp.float32)
                                     / half)
  angles_BxTx1xF = (positions_BxT[..., None, None].astype(jnp.float32)
                    * frequencies_F)
  cos, sin = jnp.cos(angles_BxTx1xF), jnp.sin(angles_BxTx1xF)
  x = x_BxTxNxH.astype(jnp.float32)
  first, second = x[..., :half], x[..., half:]
  rotated = jnp.concatenate([first * cos - second * sin,
                             first * sin + second * cos], axis=-1)
  return rotated.astype(x_BxTxNxH.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """The per-head slopes of ALiBi (Press et al. 2022): a geometric sequence
  starting at 2^(-8/n) for the nearest power of two n, interleaved with the
  next power's slopes when num_heads is not a power of two."""
  def geometric(n):
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]

  power = 2 ** int(np.floor(np.log2(num_heads)))
  slopes = geometric(power)
  if power < num_heads:
    slopes += geometric(2 * power)[0::2][:num_heads - power]
  return np.asarray(slopes, np.float32)


def alibi_bias(q_positions_BxT: Array, kv_positions_BxS: Array,
               num_heads: int) -> Array:
  """[B, N, T, S]: -slope_n * |i - j|, a penalty growing with distance."""
  distance = jnp.abs(q_positions_BxT[:, None, :, None]
                     - kv_positions_BxS[:, None, None, :])
  slopes = alibi_slopes(num_heads)[None, :, None, None]
  return -slopes * distance.astype(jnp.float32)


def t5_buckets(relative_BxTxS: Array, *, bidirectional: bool,
               num_buckets: int, max_distance: int) -> Array:
  """Bucket of each relative position j - i (Raffel et al. 2020): half the
  buckets hold small distances exactly, the rest logarithmically larger ones
  up to max_distance; bidirectional buckets split by sign."""
  buckets = jnp.zeros_like(relative_BxTxS)
  if bidirectional:
    num_buckets //= 2
    buckets = jnp.where(relative_BxTxS > 0, num_buckets, 0)
    distance = jnp.abs(relative_BxTxS)
  else:
    distance = jnp.maximum(-relative_BxTxS, 0)
  exact = num_buckets // 2
  large = exact + (
      jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact)
      / np.log(max_distance / exact) * (num_buckets - exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return buckets + jnp.where(distance < exact, distance, large)


class T5Bias(nn.Module):
  """A learned bias per head and relative-distance bucket: [B, N, T, S]."""

  num_heads: int
  num_buckets: int
  max_distance: int
  bidirectional: bool
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, q_positions_BxT: Array, kv_positions_BxS: Array):
    table = self.param(
        'embedding', nn.with_logical_partitioning(
            nn.initializers.normal(stddev=0.02), (None, 'heads')),
        (self.num_buckets, self.num_heads), self.param_dtype)
    relative = kv_positions_BxS[:, None, :] - q_positions_BxT[:, :, None]
    buckets_BxTxS = t5_buckets(relative, bidirectional=self.bidirectional,
                               num_buckets=self.num_buckets,
                               max_distance=self.max_distance)
    bias_BxTxSxN = jnp.take(table, buckets_BxTxS, axis=0)
    return jnp.transpose(bias_BxTxSxN, (0, 3, 1, 2)).astype(jnp.float32)


class ShawRelative(nn.Module):
  """Relative position representations (Shaw et al. 2018) for the keys:
  logit_ij gains q_i . a_clip(j - i), scaled like q_i . k_j, with a learned
  a per clipped distance in [-max_distance, max_distance]."""

  head_dim: int
  max_distance: int
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, query_BxTxNxH: Array, q_positions_BxT: Array,
               kv_positions_BxS: Array, scale: float) -> Array:
    """The bias [B, N, T, S] this adds to the logits."""
    table = self.param(
        'embedding', nn.with_logical_partitioning(
            nn.initializers.normal(stddev=0.02), (None, 'kv')),
        (2 * self.max_distance + 1, self.head_dim), self.param_dtype)
    scores_BxTxNxR = jnp.einsum('btnh,rh->btnr',
                                query_BxTxNxH.astype(jnp.float32),
                                table.astype(jnp.float32))
    relative = jnp.clip(kv_positions_BxS[:, None, :]
                        - q_positions_BxT[:, :, None],
                        -self.max_distance, self.max_distance)
    index_BxTxS = relative + self.max_distance
    bias_BxTxNxS = jnp.take_along_axis(
        scores_BxTxNxR, index_BxTxS[:, :, None, :], axis=-1)
    return scale * jnp.transpose(bias_BxTxNxS, (0, 2, 1, 3))
