"""Layers with parameters: multi-head attention, feed-forward, normalisation.

Every parameter carries logical axis names (embed, mlp, heads, kv_heads, kv,
vocab) so sharding rules can be attached later without touching the models.
"""

import math

import flax.linen as nn
import jax

from model import attention, attention_parameters, positions
from model.config import RELATIVE_POSITIONS, ModelConfig

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
    bias = self.param('bias', nn.with_logical_partitioning(
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
  Query heads are `config.num_heads`, key/value heads `config.num_kv_heads`
  (grouped-query or multi-query attention when fewer).
  """

  config: ModelConfig
  cross: bool = False

  def _relative_positions(self, q_BxTxNxH, k_BxSxKxH, q_positions_BxT,
                          kv_positions_BxS, is_causal):
    """Queries and keys (rotated for rope) and the bias of the relative
    position scheme, if any."""
    config = self.config
    if config.position == 'rope':
      return (positions.rotate(q_BxTxNxH, q_positions_BxT,
                               config.rope_max_wavelength),
              positions.rotate(k_BxSxKxH, kv_positions_BxS,
                               config.rope_max_wavelength), None)
    bias = None
    if config.position == 'alibi':
      bias = positions.alibi_bias(q_positions_BxT, kv_positions_BxS,
                                  config.num_heads)
    elif config.position == 't5_bias':
      bias = positions.T5Bias(
          config.num_heads, config.relative_buckets,
          config.relative_max_distance, bidirectional=not is_causal,
          param_dtype=config.weight_dtype, name='t5_bias')(
              q_positions_BxT, kv_positions_BxS)
    elif config.position == 'relative':
      bias = positions.ShawRelative(
          config.head_dim, config.relative_max_distance,
          param_dtype=config.weight_dtype, name='relative')(
              q_BxTxNxH, q_positions_BxT, kv_positions_BxS,
              scale=config.head_dim ** -0.5)
    return q_BxTxNxH, k_BxSxKxH, bias

  @nn.compact
  def __call__(self, inputs_q_BxTxD: Array, inputs_kv_BxSxD: Array, *,
               mask: Array | None = None, is_causal: bool = False,
               q_positions_BxT: Array | None = None,
               kv_positions_BxS: Array | None = None,
               deterministic: bool = True) -> Array:
    """Attention output [B, T, D]; positions are needed by relative schemes
    (self-attention only)."""
    config = self.config
    heads, kv_heads, head_dim = (config.num_heads, config.num_kv_heads,
                                 config.head_dim)
    q_BxTxNxH = _dense((heads, head_dim), ('embed', 'heads', 'kv'), config,
                       'query')(inputs_q_BxTxD)
    k_BxSxKxH = _dense((kv_heads, head_dim), ('embed', 'kv_heads', 'kv'),
                       config, 'key')(inputs_kv_BxSxD)
    v_BxSxKxH = _dense((kv_heads, head_dim), ('embed', 'kv_heads', 'kv'),
                       config, 'value')(inputs_kv_BxSxD)
    bias = None
    if self.cross:
      variant, kwargs = attention.spec('dense'), {}
    else:
      variant = attention.spec(config.attention)
      kwargs = attention_parameters.variant_kwargs(self, config)
      if config.position in RELATIVE_POSITIONS:
        q_BxTxNxH, k_BxSxKxH, bias = self._relative_positions(
            q_BxTxNxH, k_BxSxKxH, q_positions_BxT, kv_positions_BxS,
            is_causal)
    if self.is_mutable_collection('intermediates'):
      # For pictures (experiments/attention_maps.py): the softmax weights
      # [B, N, T, S] of exact attention under this layer's mask.
      self.sow('intermediates', 'attention_weights',
               attention.attention_weights(q_BxTxNxH, k_BxSxKxH, bias, mask,
                                           is_causal=is_causal))
    if variant.dropout and not deterministic and (
        config.attention_dropout_rate > 0.0):
      kwargs |= {'dropout_rate': config.attention_dropout_rate,
                 'dropout_rng': self.make_rng('dropout')}
    out_BxTxNxH = variant.fn(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias, mask,
                             is_causal=is_causal, **kwargs)
    return _dense(inputs_q_BxTxD.shape[-1], ('heads', 'kv', 'embed'), config,
                  'out', num_in=2)(out_BxTxNxH)


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
  scale_init = nn.with_logical_partitioning(nn.initializers.ones, ('embed',))
  common = dict(dtype=config.compute_dtype, param_dtype=config.weight_dtype,
                scale_init=scale_init, name=name)
  if config.norm == 'rmsnorm':
    return nn.RMSNorm(**common)
  return nn.LayerNorm(
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)),
      **common)
