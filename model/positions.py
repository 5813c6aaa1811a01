"""Position information: absolute encodings added to the token embeddings,
and relative ones applied inside self-attention; SCHEMES says what each
scheme (config.model.position) does, for the model, decoding and the
config checks to ask.
"""

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import attention

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
           max_wavelength: float = 10_000.0, fraction: float = 1.0) -> Array:
  """Rotary position embedding (Su et al. 2021) of the first R = fraction *
  H channels of each head; the others pass unchanged (GPT-NeoX's partial
  rotation).

  Channel pairs (i, i + R/2) rotate by the angle position * max_wavelength
  ^ (-2i / R), so the dot product of a rotated query and key depends on
  their positions only through the difference.
  """
  rotated_dims = rotated_width(x_BxTxNxH.shape[-1], fraction)
  half = rotated_dims // 2
  frequencies_F = max_wavelength ** (-jnp.arange(half, dtype=jnp.float32)
                                     / half)
  angles_BxTx1xF = (positions_BxT[..., None, None].astype(jnp.float32)
                    * frequencies_F)
  cos, sin = jnp.cos(angles_BxTx1xF), jnp.sin(angles_BxTx1xF)
  x = x_BxTxNxH.astype(jnp.float32)
  first, second = x[..., :half], x[..., half:rotated_dims]
  rotated = jnp.concatenate([first * cos - second * sin,
                             first * sin + second * cos,
                             x[..., rotated_dims:]], axis=-1)
  return rotated.astype(x_BxTxNxH.dtype)


def rotated_width(head_dim: int, fraction: float) -> int:
  """The channels of a head that rope rotates (config.model.rope_fraction
  of them; ModelConfig checks that this is an even whole number)."""
  return round(head_dim * fraction)


def rotated_channels(config) -> int:
  """The channels of each head that the position scheme of `config` (a
  ModelConfig) rotates: 0 where it rotates none."""
  if not SCHEMES[config.position].rotation:
    return 0
  return rotated_width(config.head_dim, config.rope_fraction)


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


# The axes of the positions a position bias reads (PositionBias.axes).
_POSITION_AXES = {'q_positions': ('batch', 'query'),
                  'kv_positions': ('batch', 'key')}


def _relative(data) -> Array:
  """key position - query position of a score function's pairs."""
  return data['kv_positions'] - data['q_positions']


def _at_distance(table_RxI: Array, distance_I: Array) -> Array:
  """table[distance, i] for each pair i: a per-query (or per-key) table of
  scores by distance, read at each pair's distance bucket."""
  return jnp.take_along_axis(table_RxI, distance_I[None], axis=0)[0]


def _alibi(s, data, q_index, k_index, head) -> Array:
  del q_index, k_index, head
  return s - data['slopes'] * jnp.abs(_relative(data)).astype(jnp.float32)


def alibi_bias(q_positions_BxT: Array, kv_positions_BxS: Array,
               num_heads: int) -> attention.PositionBias:
  """-slope_n * |i - j| for head n: a penalty growing with distance."""
  return attention.PositionBias(
      {'q_positions': q_positions_BxT, 'kv_positions': kv_positions_BxS,
       'slopes': jnp.asarray(alibi_slopes(num_heads))}, _alibi,
      _POSITION_AXES | {'slopes': ('head',)}, name="ALiBi's bias")


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
  """A learned bias per head and relative-distance bucket."""

  num_heads: int
  num_buckets: int
  max_distance: int
  bidirectional: bool
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, q_positions_BxT: Array, kv_positions_BxS: Array
               ) -> attention.PositionBias:
    table = self.param(
        'embedding', nn.with_logical_partitioning(
            nn.initializers.normal(stddev=0.02), (None, 'heads')),
        (self.num_buckets, self.num_heads), self.param_dtype)
    buckets = functools.partial(
        t5_buckets, bidirectional=self.bidirectional,
        num_buckets=self.num_buckets, max_distance=self.max_distance)

    def score(s, data, q_index, k_index, head):
      del q_index, k_index, head
      return s + attention.lookup(data['table'], buckets(_relative(data)))

    return attention.PositionBias(
        {'q_positions': q_positions_BxT, 'kv_positions': kv_positions_BxS,
         'table': table}, score, _POSITION_AXES | {'table': (None, 'head')},
        name="T5's bias")


class ShawRelative(nn.Module):
  """Relative position representations (Shaw et al. 2018) for the keys:
  logit_ij gains q_i . a_clip(j - i), scaled like q_i . k_j, with a learned
  a per clipped distance in [-max_distance, max_distance]."""

  head_dim: int
  max_distance: int
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, query_BxTxNxH: Array, q_positions_BxT: Array,
               kv_positions_BxS: Array, scale: float
               ) -> attention.PositionBias:
    table = self.param(
        'embedding', nn.with_logical_partitioning(
            nn.initializers.normal(stddev=0.02), (None, 'kv')),
        (2 * self.max_distance + 1, self.head_dim), self.param_dtype)
    # Each query against each distance: [B, N, T, R], linear in T.
    scores_BxNxTxR = scale * jnp.einsum(
        'btnh,rh->bntr', query_BxTxNxH.astype(jnp.float32),
        table.astype(jnp.float32))
    max_distance = self.max_distance

    def score(s, data, q_index, k_index, head):
      del q_index, k_index, head
      distance = jnp.clip(_relative(data), -max_distance,
                          max_distance) + max_distance
      return s + _at_distance(data['scores'], distance)

    return attention.PositionBias(
        {'q_positions': q_positions_BxT, 'kv_positions': kv_positions_BxS,
         'scores': scores_BxNxTxR}, score,
        _POSITION_AXES | {'scores': ('batch', 'head', 'query', None)},
        name="Shaw's relative scores")


def deberta_scale(head_dim: int) -> float:
  """DeBERTa's logit scale, 1 / sqrt(3 H): three terms, each of variance
  about H."""
  return (3 * head_dim) ** -0.5


def deberta_buckets(relative_BxI: Array, max_distance: int) -> Array:
  """delta of a (query - key) distance (He et al. 2021): clipped to
  [-k, k - 1] and shifted to [0, 2k), k = max_distance."""
  return jnp.clip(relative_BxI, -max_distance, max_distance - 1) + max_distance


class DisentangledBias(nn.Module):
  """DeBERTa's disentangled attention (He et al. 2021) as a bias on the
  content logits q_i . k_j: the content-to-position term q_i . Kr_d(i,j)
  plus the position-to-content term k_j . Qr_d(j,i), where d(i,j) is the
  clipped distance i - j (`deberta_buckets`), Kr = P Wkr and Qr = P Wqr
  project a learned table P [2k, D] of relative positions per head, and
  every term is scaled by `scale` (DeBERTa's 1 / sqrt(3 H), the attention
  scaling the content term alike). This layer holds its own table; DeBERTa
  shares one across the layers.
  """

  num_heads: int
  head_dim: int
  max_distance: int
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, query_BxTxNxH: Array, key_BxSxKxH: Array,
               q_positions_BxT: Array, kv_positions_BxS: Array,
               inputs_width: int, scale: float) -> attention.PositionBias:
    table_RxD = self.param(
        'embedding', nn.with_logical_partitioning(
            nn.initializers.normal(stddev=0.02), (None, 'embed')),
        (2 * self.max_distance, inputs_width), self.param_dtype)
    kernel = lambda name: self.param(
        name, nn.with_logical_partitioning(
            nn.initializers.xavier_uniform(), ('embed', 'heads', 'kv')),
        (inputs_width, self.num_heads, self.head_dim), self.param_dtype)
    f32 = lambda x: x.astype(jnp.float32)
    key_positions_RxNxH = jnp.einsum('rd,dnh->rnh', f32(table_RxD),
                                     f32(kernel('key_position')))
    query_positions_RxNxH = jnp.einsum('rd,dnh->rnh', f32(table_RxD),
                                       f32(kernel('query_position')))
    group = self.num_heads // key_BxSxKxH.shape[2]
    key_BxSxNxH = jnp.repeat(f32(key_BxSxKxH), group, axis=2)
    # Each query against each distance, each key against each: [B, N, T, R]
    # and [B, N, S, R], linear in the length.
    c2p_BxNxTxR = scale * jnp.einsum('btnh,rnh->bntr', f32(query_BxTxNxH),
                                     key_positions_RxNxH)
    p2c_BxNxSxR = scale * jnp.einsum('bsnh,rnh->bnsr', key_BxSxNxH,
                                     query_positions_RxNxH)
    max_distance = self.max_distance

    def score(s, data, q_index, k_index, head):
      del q_index, k_index, head
      key_minus_query = _relative(data)  # j - i
      return (s + _at_distance(data['c2p'],
                               deberta_buckets(-key_minus_query, max_distance))
              + _at_distance(data['p2c'],
                             deberta_buckets(key_minus_query, max_distance)))

    return attention.PositionBias(
        {'q_positions': q_positions_BxT, 'kv_positions': kv_positions_BxS,
         'c2p': c2p_BxNxTxR, 'p2c': p2c_BxNxSxR}, score,
        _POSITION_AXES | {'c2p': ('batch', 'head', 'query', None),
                          'p2c': ('batch', 'head', 'key', None)},
        name="DeBERTa's disentangled scores")


def random_positions(key: Array, batch: int, length: int,
                     max_positions: int) -> Array:
  """[batch, length] int32: each row `length` distinct positions drawn
  uniformly from [0, max_positions), in increasing order (Ruoss et al.
  2023: a model trained on them has met every position up to
  max_positions, however short its sequences)."""
  scores_BxP = jax.random.uniform(key, (batch, max_positions))
  _, drawn_BxL = jax.lax.top_k(scores_BxP, length)  # A random subset.
  return jnp.sort(drawn_BxL, axis=-1).astype(jnp.int32)


# --- The schemes, by the name config.model.position gives. ---


@dataclasses.dataclass(frozen=True)
class PositionScheme:
  """What a position scheme does to a model; `config` is the model's
  ModelConfig. Absolute schemes add an embedding of each position to the
  token embeddings; relative ones act inside self-attention, by a bias on
  its logits or by rotating its queries and keys."""

  name: str
  # config -> a layer of positions [B, T] to [B, T, D], added to the token
  # embeddings (a Module, which the embedder names).
  embedding: Callable[[Any], Callable[[Array], Array]] | None = None
  # (layer, config, q, k, q_positions, kv_positions) -> the bias [B, N, T,
  # S] of self-attention's logits, as a PositionBias; (config, causal) ->
  # the layer holding its parameters (None: it has none).
  bias: Callable[..., attention.PositionBias] | None = None
  bias_layer: Callable[[Any, bool], nn.Module] | None = None
  # Rotates self-attention's queries and keys by position (config -> the
  # keyword arguments of `rotate`: the largest wavelength, the fraction of
  # each head rotated).
  rotation: Callable[[Any], dict[str, float]] | None = None
  # config -> the scale of self-attention's logits, in place of the
  # attention's own.
  logit_scale: Callable[[Any], float] | None = None
  # config -> the number of positions it can represent (None: any).
  max_positions: Callable[[Any], int | None] = lambda config: None
  # In training, each example's positions are random_positions of
  # [0, max_positions) instead of 0..T-1, drawn by the family (which must
  # declare Family.random_positions); evaluation and decoding read 0..T-1.
  randomized: bool = False

  @property
  def relative(self) -> bool:
    """It acts inside self-attention, on relative positions only."""
    return self.bias is not None or self.rotation is not None


def _sinusoidal_embedding(config) -> Callable[[Array], Array]:
  return functools.partial(sinusoidal, d_model=config.d_model)


def _learned_embedding(config) -> nn.Module:
  return LearnedPositions(config.max_len, config.d_model,
                          config.weight_dtype, name='learned_positions')


def _shaw_layer(config, causal: bool) -> nn.Module:
  del causal
  return ShawRelative(config.head_dim, config.relative_max_distance,
                      param_dtype=config.weight_dtype, name='relative')


def _shaw_bias(layer, config, q_BxTxNxH, k_BxSxKxH, q_positions_BxT,
               kv_positions_BxS) -> attention.PositionBias:
  del k_BxSxKxH
  return layer(q_BxTxNxH, q_positions_BxT, kv_positions_BxS,
               scale=config.head_dim ** -0.5)


def _t5_layer(config, causal: bool) -> nn.Module:
  return T5Bias(config.num_heads, config.relative_buckets,
                config.relative_max_distance, bidirectional=not causal,
                param_dtype=config.weight_dtype, name='t5_bias')


def _t5_bias(layer, config, q_BxTxNxH, k_BxSxKxH, q_positions_BxT,
             kv_positions_BxS) -> attention.PositionBias:
  del config, q_BxTxNxH, k_BxSxKxH
  return layer(q_positions_BxT, kv_positions_BxS)


def _alibi_bias(layer, config, q_BxTxNxH, k_BxSxKxH, q_positions_BxT,
                kv_positions_BxS) -> attention.PositionBias:
  del layer, q_BxTxNxH, k_BxSxKxH
  return alibi_bias(q_positions_BxT, kv_positions_BxS, config.num_heads)


def _deberta_layer(config, causal: bool) -> nn.Module:
  del causal
  return DisentangledBias(config.num_heads, config.head_dim,
                          config.relative_max_distance,
                          param_dtype=config.weight_dtype,
                          name='disentangled')


def _deberta_bias(layer, config, q_BxTxNxH, k_BxSxKxH, q_positions_BxT,
                  kv_positions_BxS) -> attention.PositionBias:
  return layer(q_BxTxNxH, k_BxSxKxH, q_positions_BxT, kv_positions_BxS,
               config.d_model, deberta_scale(config.head_dim))


SCHEMES: dict[str, PositionScheme] = {scheme.name: scheme for scheme in (
    PositionScheme('none'),
    PositionScheme('sinusoidal', embedding=_sinusoidal_embedding),
    PositionScheme('learned', embedding=_learned_embedding,
                   max_positions=lambda config: config.max_len),
    # Sinusoidal encodings of positions drawn from [0, max_len) in training.
    PositionScheme('random_sinusoidal', embedding=_sinusoidal_embedding,
                   max_positions=lambda config: config.max_len,
                   randomized=True),
    PositionScheme('relative', bias_layer=_shaw_layer, bias=_shaw_bias),
    PositionScheme('t5_bias', bias_layer=_t5_layer, bias=_t5_bias),
    PositionScheme('rope',
                   rotation=lambda config: dict(
                       max_wavelength=config.rope_max_wavelength,
                       fraction=config.rope_fraction)),
    PositionScheme('alibi', bias=_alibi_bias),
    # Content logits take DeBERTa's scale too.
    PositionScheme('deberta', bias_layer=_deberta_layer, bias=_deberta_bias,
                   logit_scale=lambda config: deberta_scale(config.head_dim)),
)}
