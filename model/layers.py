"""Layers with parameters: multi-head attention, feed-forward, normalisation.

Every parameter carries logical axis names (embed, mlp, heads, kv_heads, kv,
vocab) so sharding rules can be attached later without touching the models.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import attention, attention_parameters, positions
from model.config import RELATIVE_POSITIONS, ModelConfig
from model.weight_decay import undecayed

Array = jax.Array

_KERNEL_INIT = nn.initializers.xavier_uniform()


class Projection(nn.Module):
  """x @ kernel + bias, contracting the last `num_in` dims of x into the
  dims `features`; the kernel's dims carry the logical names `axes` (input
  dims, then output dims) and the bias the output ones.

  Like nn.DenseGeneral, and initialised identically (Xavier over the
  flattened kernel), but its parameters are created at their full shape, so
  their logical names hold when read under sharding rules.
  """

  features: tuple[int, ...]
  axes: tuple[str, ...]
  num_in: int
  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    in_shape = x.shape[x.ndim - self.num_in:]

    def kernel_init(rng, shape, dtype):
      flat = (math.prod(in_shape), math.prod(self.features))
      return _KERNEL_INIT(rng, flat, dtype).reshape(shape)

    kernel = self.param('kernel', nn.with_logical_partitioning(
        kernel_init, self.axes), in_shape + self.features,
                        self.config.weight_dtype)
    bias = self.param('bias', undecayed(
        nn.initializers.zeros, self.axes[self.num_in:]), self.features,
                      self.config.weight_dtype)
    x, kernel, bias = nn.dtypes.promote_dtype(
        x, kernel, bias, dtype=self.config.compute_dtype)
    contract = (tuple(range(x.ndim - self.num_in, x.ndim)),
                tuple(range(self.num_in)))
    return jax.lax.dot_general(x, kernel, (contract, ((), ()))) + bias


def _dense(features, axes, config: ModelConfig, name: str,
           num_in: int = 1) -> Projection:
  """A Projection of the last `num_in` dims into `features` (an int or a
  tuple), its kernel carrying the logical axes `axes`."""
  features = features if isinstance(features, tuple) else (features,)
  return Projection(features, axes, num_in, config, name=name)


class MultiHeadAttention(nn.Module):
  """Q/K/V/O projections around an attention function.

  Self-attention uses `config.attention` with `config.attention_options`
  (creating the parameters a variant owns, see model/attention_parameters)
  and applies relative position information; cross-attention is dense.
  With `config.attention_projections` False, self-attention has no
  parameters: the inputs are queries, keys and values of one head, the
  logits unscaled, and the output is not projected.
  Query heads are `config.num_heads`, key/value heads `config.num_kv_heads`
  (grouped-query or multi-query attention when fewer).
  """

  config: ModelConfig
  cross: bool = False

  def _position_bias(self, q_BxTxNxH, k_BxSxKxH, q_positions_BxT,
                     kv_positions_BxS, is_causal):
    """The logit bias of the relative position scheme (None for rope and
    the absolute schemes)."""
    config = self.config
    if config.position == 'deberta':
      return positions.DisentangledBias(
          config.num_heads, config.head_dim, config.relative_max_distance,
          param_dtype=config.weight_dtype, name='disentangled')(
              q_BxTxNxH, k_BxSxKxH, q_positions_BxT, kv_positions_BxS,
              config.d_model, positions.deberta_scale(config.head_dim))
    if config.position == 'alibi':
      return positions.alibi_bias(q_positions_BxT, kv_positions_BxS,
                                  config.num_heads)
    if config.position == 't5_bias':
      return positions.T5Bias(
          config.num_heads, config.relative_buckets,
          config.relative_max_distance, bidirectional=not is_causal,
          param_dtype=config.weight_dtype, name='t5_bias')(
              q_positions_BxT, kv_positions_BxS)
    if config.position == 'relative':
      return positions.ShawRelative(
          config.head_dim, config.relative_max_distance,
          param_dtype=config.weight_dtype, name='relative')(
              q_BxTxNxH, q_positions_BxT, kv_positions_BxS,
              scale=config.head_dim ** -0.5)
    return None

  def _rotate(self, x, positions_BxT):
    """`x` [B, T, heads, H] rotated by position for rope; else `x`."""
    if self.config.position != 'rope':
      return x
    return positions.rotate(x, positions_BxT, self.config.rope_max_wavelength)

  @nn.compact
  def __call__(self, inputs_q_BxTxD: Array, inputs_kv_BxSxD: Array, *,
               mask: Array | None = None, is_causal: bool = False,
               q_positions_BxT: Array | None = None,
               kv_positions_BxS: Array | None = None,
               cache: dict[str, Array] | None = None,
               deterministic: bool = True):
    """Attention output [B, T, D]; positions are needed by relative schemes
    (self-attention only).

    With a `cache` (self-attention; see `init_cache` in model/families.py):
    {'key', 'value'} [B, C, K, H], the keys and values of positions 0..C-1
    written so far. This call's keys and values are written at
    `q_positions_BxT`, each query attends to the cached positions up to its
    own, and the result is (output, cache): a prompt of any length is read
    in one call, then one token a call.

    With a `cache` for cross-attention: {} (project `inputs_kv_BxSxD`) or
    the {'key', 'value'} [B, S, K, H] a call returned (`inputs_kv_BxSxD` is
    not read); the queries may be `copies` consecutive rows per source row
    (beam search's layout). Returns (output, {'key', 'value'}).
    """
    config = self.config
    q_BxTxNxH = self._queries(inputs_q_BxTxD)
    if self.cross and cache is not None:
      return self._cached_cross(q_BxTxNxH, inputs_kv_BxSxD, mask, cache,
                                inputs_q_BxTxD.shape[-1])
    k_BxSxKxH, v_BxSxKxH = self._keys_values(inputs_kv_BxSxD)
    bias = None
    if self.cross:
      if cache is not None:
        return self._cross_from_cache(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask,
                                      inputs_q_BxTxD.shape[-1])
      variant, kwargs = attention.spec('dense'), {}
    else:
      variant = attention.spec(config.attention)
      kwargs = attention_parameters.variant_kwargs(self, config)
      if self._parameter_free:
        if config.attention in attention_parameters.PARAMETERS:
          raise ValueError(
              f'config.model.attention={config.attention!r} has parameters '
              'of its own; config.model.attention_projections=False wants '
              'none.')
        kwargs['scale'] = 1.0
      if config.position == 'deberta':
        # Content logits take DeBERTa's scale too.
        kwargs['scale'] = positions.deberta_scale(config.head_dim)
      q_BxTxNxH = self._rotate(q_BxTxNxH, q_positions_BxT)
      k_BxSxKxH = self._rotate(k_BxSxKxH, kv_positions_BxS)
    if cache is not None:
      if not variant.reads_cache:
        raise ValueError(
            f'config.model.attention={config.attention!r} cannot read a cache '
            '(cached decoding needs dense, chunked or additive attention).')
      if 'kernel' in kwargs:  # No fused kernel reads a cache.
        kwargs['kernel'] = 'auto'
      cache = _write(cache, k_BxSxKxH, v_BxSxKxH, q_positions_BxT)
      k_BxSxKxH, v_BxSxKxH = cache['key'], cache['value']
      kv_positions_BxS = jnp.broadcast_to(
          jnp.arange(k_BxSxKxH.shape[1]), k_BxSxKxH.shape[:2])
      written = (kv_positions_BxS[:, None, None, :]
                 <= q_positions_BxT[:, None, :, None])
      mask = written if mask is None else mask & written
    if not self.cross and config.position in RELATIVE_POSITIONS:
      bias = self._position_bias(q_BxTxNxH, k_BxSxKxH, q_positions_BxT,
                                 kv_positions_BxS, is_causal)
    # With a cache, the mask says what each query sees.
    causal = is_causal and cache is None
    if self.is_mutable_collection('intermediates'):
      # For pictures (experiments/attention_maps.py): the softmax weights
      # [B, N, T, S] of exact attention under this layer's mask.
      self.sow('intermediates', 'attention_weights',
               attention.attention_weights(q_BxTxNxH, k_BxSxKxH, bias, mask,
                                           scale=kwargs.get('scale'),
                                           is_causal=causal))
    if variant.dropout and not deterministic and (
        config.attention_dropout_rate > 0.0):
      kwargs |= {'dropout_rate': config.attention_dropout_rate,
                 'dropout_rng': self.make_rng('dropout')}
    out_BxTxNxH = variant.fn(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias, mask,
                             is_causal=causal, **kwargs)
    out_BxTxD = self._out(out_BxTxNxH, inputs_q_BxTxD.shape[-1])
    return out_BxTxD if cache is None else (out_BxTxD, cache)

  @property
  def _parameter_free(self) -> bool:
    """Self-attention of the inputs themselves, with no projections."""
    return not self.cross and not self.config.attention_projections

  def _queries(self, inputs_q_BxTxD: Array) -> Array:
    """Queries [B, T, N, H] of the inputs ([B, T, 1, D] parameter-free)."""
    if self._parameter_free:
      return inputs_q_BxTxD[:, :, None]
    return _dense((self.config.num_heads, self.config.head_dim),
                  ('embed', 'heads', 'kv'), self.config,
                  'query')(inputs_q_BxTxD)

  def _out(self, x_BxTxNxH: Array, features: int) -> Array:
    if self._parameter_free:
      return x_BxTxNxH.reshape(*x_BxTxNxH.shape[:2], features)
    return _dense(features, ('heads', 'kv', 'embed'), self.config, 'out',
                  num_in=2)(x_BxTxNxH)

  def _keys_values(self, inputs_kv_BxSxD: Array) -> tuple[Array, Array]:
    """Keys and values [B, S, K, H] of the inputs ([B, S, 1, D] each
    parameter-free)."""
    if self._parameter_free:
      return inputs_kv_BxSxD[:, :, None], inputs_kv_BxSxD[:, :, None]
    config = self.config
    features = (config.num_kv_heads, config.head_dim)
    return tuple(_dense(features, ('embed', 'kv_heads', 'kv'), config,
                        name)(inputs_kv_BxSxD) for name in ('key', 'value'))

  def _cached_cross(self, q_BxTxNxH: Array, inputs_kv_BxSxD: Array | None,
                    mask: Array | None, cache: dict[str, Array],
                    features: int) -> tuple[Array, dict[str, Array]]:
    """Cross-attention while decoding: the source's keys and values are
    projected once and read by every beam of it, never copied."""
    if cache:
      k_BxSxKxH, v_BxSxKxH = cache['key'], cache['value']
    else:
      k_BxSxKxH, v_BxSxKxH = self._keys_values(inputs_kv_BxSxD)
    rows, length = q_BxTxNxH.shape[:2]
    copies = rows // k_BxSxKxH.shape[0]
    # [B * copies, T] queries as [B, copies * T]: each row's beams together.
    q_BxCTxNxH = q_BxTxNxH.reshape(k_BxSxKxH.shape[0], copies * length,
                                   *q_BxTxNxH.shape[2:])
    out_BxCTxNxH = attention.scaled_dot_product_attention(
        q_BxCTxNxH, k_BxSxKxH, v_BxSxKxH, None, mask)
    out_BxTxD = self._out(out_BxCTxNxH.reshape(q_BxTxNxH.shape), features)
    return out_BxTxD, {'key': k_BxSxKxH, 'value': v_BxSxKxH}


def _write(cache: dict[str, Array], k_BxTxKxH: Array, v_BxTxKxH: Array,
           positions_BxT: Array) -> dict[str, Array]:
  """The cache with each example's new keys and values at its positions."""
  rows_BxT = jnp.broadcast_to(jnp.arange(positions_BxT.shape[0])[:, None],
                              positions_BxT.shape)
  return {
      'key': cache['key'].at[rows_BxT, positions_BxT].set(
          k_BxTxKxH.astype(cache['key'].dtype)),
      'value': cache['value'].at[rows_BxT, positions_BxT].set(
          v_BxTxKxH.astype(cache['value'].dtype))}


class Mlp(nn.Module):
  """Position-wise feed-forward layer: d_model -> mlp_dim -> d_model."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD: Array) -> Array:
    config = self.config
    hidden = _dense(config.mlp_dim, ('embed', 'mlp'), config, 'wi')(x_BxTxD)
    if config.mlp_activation == 'swiglu':
      gate = _dense(config.mlp_dim, ('embed', 'mlp'), config, 'wi_gate')(
          x_BxTxD)
      hidden_BxTxM = nn.silu(gate) * hidden
    else:
      activation = {'relu': nn.relu, 'gelu': nn.gelu}[config.mlp_activation]
      hidden_BxTxM = activation(hidden)
    return _dense(x_BxTxD.shape[-1], ('mlp', 'embed'), config, 'wo')(
        hidden_BxTxM)


def make_norm(config: ModelConfig, name: str) -> nn.Module:
  """LayerNorm or RMSNorm as `config.norm` says, statistics in float32."""
  scale_init = undecayed(nn.initializers.ones, ('embed',))
  common = dict(dtype=config.compute_dtype, param_dtype=config.weight_dtype,
                scale_init=scale_init, name=name)
  if config.norm == 'rmsnorm':
    return nn.RMSNorm(**common)
  return nn.LayerNorm(
      bias_init=undecayed(nn.initializers.zeros, ('embed',)),
      **common)
