"""Layers with parameters: multi-head attention, feed-forward, normalisation.

Every parameter carries logical axis names (embed, mlp, heads, kv_heads, kv,
vocab) so sharding rules can be attached later without touching the models.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import activations, attention, positions
from model.attention import options as variant_options
from model.attention.core import logical_axes
from model.attention.kernels import fused
from model.config import ModelConfig
from model.state import KeysValues, LatentCache, RecurrentState
from model.weight_decay import undecayed

Array = jax.Array

_KERNEL_INIT = nn.initializers.xavier_uniform()
# The name scope of the attention function's call (scores, softmax, values;
# a fused kernel): what a profile counts as attention
# (experiments/profile.py).
ATTENTION_SCOPE = 'attention_core'


class Projection(nn.Module):
  """x @ kernel (+ bias, where config.use_bias), contracting the last
  `num_in` dims of x into the dims `features`; the kernel's dims carry the
  logical names `axes` (input dims, then output dims) and the bias the
  output ones.

  Like nn.DenseGeneral, and initialised identically (Xavier over the
  flattened kernel), but its parameters are created at their full shape, so
  their logical names hold when read under sharding rules.
  """

  features: tuple[int, ...]
  axes: tuple[str, ...]
  num_in: int
  config: ModelConfig
  # The kernel starts at zero (config.model.zero_init_outputs).
  zero_init: bool = False

  @nn.compact
  def __call__(self, x: Array) -> Array:
    in_shape = x.shape[x.ndim - self.num_in:]

    def kernel_init(rng, shape, dtype):
      if self.zero_init:
        return jnp.zeros(shape, dtype)
      flat = (math.prod(in_shape), math.prod(self.features))
      return _KERNEL_INIT(rng, flat, dtype).reshape(shape)

    kernel = self.param('kernel', nn.with_logical_partitioning(
        kernel_init, self.axes), in_shape + self.features,
                        self.config.weight_dtype)
    x, kernel = nn.dtypes.promote_dtype(
        x, kernel, dtype=self.config.compute_dtype)
    contract = (tuple(range(x.ndim - self.num_in, x.ndim)),
                tuple(range(self.num_in)))
    y = jax.lax.dot_general(x, kernel, (contract, ((), ())))
    if not self.config.use_bias:
      return y
    bias = self.param('bias', undecayed(
        nn.initializers.zeros, self.axes[self.num_in:]), self.features,
                      self.config.weight_dtype)
    return y + bias.astype(y.dtype)


def _dense(features, axes, config: ModelConfig, name: str,
           num_in: int = 1, zero_init: bool = False) -> Projection:
  """A Projection of the last `num_in` dims into `features` (an int or a
  tuple), its kernel carrying the logical axes `axes` (zeros at first with
  `zero_init`)."""
  features = features if isinstance(features, tuple) else (features,)
  return Projection(features, axes, num_in, config, zero_init, name=name)


class MultiHeadAttention(nn.Module):
  """Q/K/V/O projections around an attention function.

  Self-attention uses `config.attention` with `config.attention_options`
  (creating the parameters a variant owns: Variant.parameters)
  and applies relative position information; cross-attention is dense.
  With `config.attention_projections` False, self-attention has no
  parameters: the inputs are queries, keys and values of one head, the
  logits unscaled, and the output is not projected.
  Query heads are `config.num_heads`, key/value heads `config.num_kv_heads`
  (grouped-query or multi-query attention when fewer). With
  `config.attention_sinks`, self-attention learns a sink logit per query
  head (`sinks` [N]) in its softmax's normaliser.
  """

  config: ModelConfig
  cross: bool = False
  # Each query attends to keys at its position and before (self-attention
  # of a decoder).
  causal: bool = False
  # Its values are mixed with a first layer's (config.value_residual).
  mixes_values: bool = False
  # A value embedding table's rows, gated, are added to its values
  # (config.value_embeddings).
  adds_value_embedding: bool = False

  def setup(self):
    config = self.config
    if self._parameter_free:
      if attention.spec(config.attention).parameters:
        raise ValueError(
            f'config.model.attention={config.attention!r} has parameters '
            'of its own; config.model.attention_projections=False wants '
            'none.')
    else:
      heads = (config.num_heads, config.head_dim)
      kv_heads = (config.num_kv_heads, config.head_dim)
      heads_axis, kv_heads_axis = logical_axes.HEADS, logical_axes.KV_HEADS
      if self._latent:
        self.latent = attention.spec(config.attention).latent_projections(
            config, positions.rotated_channels(config),
            **variant_options.projection_options(config))
      else:
        self.query = _dense(heads, ('embed', heads_axis, 'kv'), config,
                            'query')
        self.key = _dense(kv_heads, ('embed', kv_heads_axis, 'kv'), config,
                          'key')
        self.value = _dense(kv_heads, ('embed', kv_heads_axis, 'kv'),
                            config, 'value')
      self.out = _dense(config.d_model, (heads_axis, 'kv', 'embed'), config,
                        'out', num_in=2, zero_init=config.zero_init_outputs)
      if config.qk_norm != 'none':  # Over each head's dims: a scale per dim.
        self.query_norm = make_norm(config, config.qk_norm, 'kv')
        self.key_norm = make_norm(config, config.qk_norm, 'kv')
      if self.mixes_values:  # (a, b) of a * v + b * v_first.
        self.value_mix = self.param(
            'value_mix', undecayed(nn.initializers.constant(0.5), (None,)),
            (2,), config.weight_dtype)
      if self.adds_value_embedding:  # g of v + g * value_embedding.
        self.value_embedding_gate = self.param(
            'value_embedding_gate',
            undecayed(nn.initializers.constant(0.5), (None,)), (1,),
            config.weight_dtype)
    if self.cross:
      self.variant, self.options = attention.spec('dense'), {}
      return
    if config.attention_sinks:  # A logit per query head, 0 at first.
      self.sinks = self.param(
          'sinks', undecayed(nn.initializers.zeros, (logical_axes.HEADS,)),
          (config.num_heads,), config.weight_dtype)
    self.variant = attention.spec(config.attention)
    self.options = variant_options.variant_kwargs(self, config)
    self.scheme = positions.SCHEMES[config.position]
    self.position_layer = (self.scheme.bias_layer(config, self.causal)
                           if self.scheme.bias_layer else None)

  def _rotate(self, x, positions_BxT):
    """`x` [B, T, heads, H] rotated by position where the scheme rotates;
    else `x`."""
    if not self.scheme.rotation:
      return x
    return positions.rotate(x, positions_BxT,
                            **self.scheme.rotation(self.config))

  def __call__(self, inputs_q_BxTxD: Array, inputs_kv_BxSxD: Array | None,
               *, mask: Array | None = None,
               q_positions_BxT: Array | None = None,
               kv_positions_BxS: Array | None = None,
               cache: KeysValues | RecurrentState | None = None,
               first_values_BxSxKxH: Array | None = None,
               value_embedding_BxSxKxH: Array | None = None,
               deterministic: bool = True
               ) -> tuple[Array, KeysValues | RecurrentState | None, Array]:
    """(attention output [B, T, D], the cache after it or None, the values
    [B, S, K, H] of this call's keys); positions are needed by relative
    schemes (self-attention only). A layer that `adds_value_embedding`
    adds g * `value_embedding_BxSxKxH` to its values; one that
    `mixes_values` then attends with a * v + b * `first_values_BxSxKxH`,
    and returns those.

    With a `cache` (self-attention; see model.state.Cache): the keys and
    values of positions 0..C-1 written so far. This call's keys and values
    are written at `q_positions_BxT`, each query attends to the cached
    positions up to its own, and the cache with them is returned: a prompt
    of any length is read in one call, then one token a call. A recurrent
    attention's cache is its state instead (model.state.RecurrentState),
    read and returned after this call's positions. With a cache, `mask` is
    None or [B, 1, 1, T], False at the padding of right-padded prompts.

    With a `cache` for cross-attention: the source's keys and values
    (`source_keys_values`; `inputs_kv_BxSxD` is not read), returned as
    they are; the queries may be `copies` consecutive rows per source row
    (beam search's layout).
    """
    q_BxTxNxH = self._queries(inputs_q_BxTxD)
    if self.cross and cache is not None:
      return self._cached_cross(q_BxTxNxH, mask, cache), cache, cache.value
    config = self.config
    source = self.source_keys_values(inputs_kv_BxSxD)
    k_BxSxKxH, v_BxSxKxH = source.key, source.value
    if self.adds_value_embedding:
      v_BxSxKxH = v_BxSxKxH + self.value_embedding_gate.astype(
          v_BxSxKxH.dtype) * value_embedding_BxSxKxH
    if self.mixes_values:
      if first_values_BxSxKxH is None:
        raise ValueError('a layer that mixes values (config.model.'
                         'value_residual) needs the first layer\'s values.')
      mix = self.value_mix.astype(v_BxSxKxH.dtype)
      v_BxSxKxH = mix[0] * v_BxSxKxH + mix[1] * first_values_BxSxKxH
    new_values_BxSxKxH = v_BxSxKxH
    kwargs = dict(self.options)
    if not self.cross:
      if self._parameter_free:
        kwargs['scale'] = 1.0
      if self.scheme.logit_scale:
        kwargs['scale'] = self.scheme.logit_scale(config)
      q_BxTxNxH = self._rotate(q_BxTxNxH, q_positions_BxT)
      k_BxSxKxH = self._rotate(k_BxSxKxH, kv_positions_BxS)
      if config.attention_sinks:
        kwargs['sinks'] = self.sinks
    variant = self.variant
    if variant.reads_inputs and not self.cross:
      kwargs['inputs'] = inputs_q_BxTxD
    if cache is not None:
      if not variant.reads_cache:
        raise ValueError(
            f'config.model.attention={config.attention!r} cannot read a cache '
            '(train/decode/decoding.py\'s cache_refusal says which can).')
      if isinstance(cache, LatentCache):
        return (*self._cached_latent(inputs_q_BxTxD, q_BxTxNxH,
                                     q_positions_BxT, cache, kwargs),
                new_values_BxSxKxH)
      if isinstance(cache, RecurrentState):
        # The call's padding (`mask`, a right-padded prompt's) leaves the
        # state as it was.
        with fused.caller(self.path), jax.named_scope(ATTENTION_SCOPE):
          out_BxTxNxH, state = variant.fn(
              q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, None, mask, is_causal=True,
              state=cache.state, **kwargs)
        return (self._out(out_BxTxNxH), cache.replace(state=state),
                new_values_BxSxKxH)
      if 'kernel' in kwargs:  # No fused kernel reads a cache.
        kwargs['kernel'] = 'auto'
      # The call's padding is written too, and overwritten by the tokens
      # that follow before any query reads it.
      cache = _write(cache, k_BxSxKxH, v_BxSxKxH, q_positions_BxT)
      k_BxSxKxH, v_BxSxKxH = cache.key, cache.value
      kv_positions_BxS = jnp.broadcast_to(
          jnp.arange(k_BxSxKxH.shape[1]), k_BxSxKxH.shape[:2])
      q_positions, kv_positions = (q_positions_BxT[:, None, :, None],
                                   kv_positions_BxS[:, None, None, :])
      written = kv_positions <= q_positions
      if variant.cache_pattern is not None:  # Dense under its pattern.
        written &= variant.cache_pattern(**kwargs)(q_positions, kv_positions)
        variant, kwargs = attention.spec('dense'), {
            key: value for key, value in kwargs.items()
            if key in ('scale', 'sinks')}
      mask = written
    bias = None
    if not self.cross and self.scheme.bias:
      bias = self.scheme.bias(
          self.position_layer, config, q_BxTxNxH, k_BxSxKxH,
          q_positions_BxT, kv_positions_BxS)
    # With a cache, the mask says what each query sees.
    causal = self.causal and cache is None
    if self.is_mutable_collection('intermediates'):
      # For pictures (experiments/attention_maps.py): the softmax weights
      # [B, N, T, S] of exact attention under this layer's mask.
      self.sow('intermediates', 'attention_weights',
               attention.attention_weights(
                   q_BxTxNxH, k_BxSxKxH, bias, mask, scale=kwargs.get('scale'),
                   is_causal=causal, logit_cap=kwargs.get('logit_cap', 0.0),
                   sinks=kwargs.get('sinks')))
    if variant.dropout and not deterministic and (
        config.attention_dropout_rate > 0.0):
      kwargs |= {'dropout_rate': config.attention_dropout_rate,
                 'dropout_rng': self.make_rng('dropout')}
    # What a fused kernel's choice records; where a profile sees attention.
    with fused.caller(self.path), jax.named_scope(ATTENTION_SCOPE):
      out_BxTxNxH = variant.fn(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias,
                               mask, is_causal=causal, **kwargs)
    return self._out(out_BxTxNxH), cache, new_values_BxSxKxH

  def _rotated_rope(self, rope_BxTxR: Array, positions_BxT: Array) -> Array:
    """Latent attention's keys' rope parts [B, T, R] rotated as the first R
    channels of a head are (`_rotate`)."""
    if not rope_BxTxR.shape[-1]:
      return rope_BxTxR
    return positions.rotate(rope_BxTxR[:, :, None], positions_BxT,
                            **self.scheme.rotation(self.config)
                            | {'fraction': 1.0})[:, :, 0]

  def _cached_latent(self, inputs_BxTxD: Array, q_BxTxNxH: Array,
                     q_positions_BxT: Array, cache: LatentCache,
                     kwargs) -> tuple[Array, LatentCache]:
    """(output, cache) of a latent attention decoding: this call's
    latents and rotated rope parts written at its positions (its padding
    too, overwritten by the tokens after it before any query reads it),
    then its queries (rotated) attend over the positions up to their own,
    keys and values never formed."""
    latent_BxTxC, rope_BxTxR = self.latent.compress(inputs_BxTxD)
    cache = cache.replace(
        latent=_put(cache.latent, latent_BxTxC, q_positions_BxT),
        rope=_put(cache.rope, self._rotated_rope(rope_BxTxR, q_positions_BxT),
                  q_positions_BxT))
    written = (jnp.arange(cache.latent.shape[1])[None, None, None, :]
               <= q_positions_BxT[:, None, :, None])
    with fused.caller(self.path), jax.named_scope(ATTENTION_SCOPE):
      out_BxTxNxH = self.latent.attend_cached(
          q_BxTxNxH, cache.latent, cache.rope, written,
          scale=kwargs.get('scale'), logit_cap=kwargs.get('logit_cap', 0.0),
          sinks=kwargs.get('sinks'))
    return self._out(out_BxTxNxH), cache

  @property
  def _latent(self) -> bool:
    """Self-attention whose variant makes its own projections from a
    latent (Variant.latent_projections)."""
    return (not self.cross and not self._parameter_free and attention.spec(
        self.config.attention).latent_projections is not None)

  @property
  def _parameter_free(self) -> bool:
    """Self-attention of the inputs themselves, with no projections."""
    return not self.cross and not self.config.attention_projections

  def _queries(self, inputs_q_BxTxD: Array) -> Array:
    """Queries [B, T, N, H] of the inputs ([B, T, 1, D] parameter-free)."""
    if self._parameter_free:
      return inputs_q_BxTxD[:, :, None]
    if self._latent:  # QK-norm is refused it (model.families.check).
      return self.latent.queries(inputs_q_BxTxD)
    q_BxTxNxH = self.query(inputs_q_BxTxD)
    return (self.query_norm(q_BxTxNxH) if self.config.qk_norm != 'none'
            else q_BxTxNxH)

  def _out(self, x_BxTxNxH: Array) -> Array:
    if self._parameter_free:
      return x_BxTxNxH.reshape(*x_BxTxNxH.shape[:2], self.config.d_model)
    return self.out(x_BxTxNxH)

  def source_keys_values(self, inputs_kv_BxSxD: Array) -> KeysValues:
    """Keys and values [B, S, K, H] of the inputs ([B, S, 1, D] each
    parameter-free): for cross-attention, what decoding projects once."""
    if self._parameter_free:
      return KeysValues(inputs_kv_BxSxD[:, :, None],
                        inputs_kv_BxSxD[:, :, None])
    if self._latent:
      return KeysValues(*self.latent.keys_values(
          *self.latent.compress(inputs_kv_BxSxD)))
    k_BxSxKxH = self.key(inputs_kv_BxSxD)
    if self.config.qk_norm != 'none':
      k_BxSxKxH = self.key_norm(k_BxSxKxH)
    return KeysValues(k_BxSxKxH, self.value(inputs_kv_BxSxD))

  def _cached_cross(self, q_BxTxNxH: Array, mask: Array | None,
                    source: KeysValues) -> Array:
    """Cross-attention while decoding: the source's keys and values are
    read by every beam of it, never copied."""
    rows, length = q_BxTxNxH.shape[:2]
    copies = rows // source.key.shape[0]
    # [B * copies, T] queries as [B, copies * T]: each row's beams together.
    q_BxCTxNxH = q_BxTxNxH.reshape(source.key.shape[0], copies * length,
                                   *q_BxTxNxH.shape[2:])
    out_BxCTxNxH = attention.scaled_dot_product_attention(
        q_BxCTxNxH, source.key, source.value, None, mask)
    return self._out(out_BxCTxNxH.reshape(q_BxTxNxH.shape))


def is_self_attention_call(context) -> bool:
  """Whether a Flax method interceptor's `context` (nn.intercept_methods)
  is a self-attention layer's forward call: what attention transfer
  (train/run/attention_transfer.py) records in one model and replays in
  another."""
  return (isinstance(context.module, MultiHeadAttention)
          and not context.module.cross and context.method_name == '__call__')


def _put(cached_BxSx: Array, new_BxTx: Array, positions_BxT: Array
         ) -> Array:
  """`cached_BxSx` with each example's `new_BxTx` entries at its
  positions."""
  rows_BxT = jnp.broadcast_to(jnp.arange(positions_BxT.shape[0])[:, None],
                              positions_BxT.shape)
  return cached_BxSx.at[rows_BxT, positions_BxT].set(
      new_BxTx.astype(cached_BxSx.dtype))


def _write(cache: KeysValues, k_BxTxKxH: Array, v_BxTxKxH: Array,
           positions_BxT: Array) -> KeysValues:
  """The cache with each example's new keys and values at its positions."""
  return KeysValues(_put(cache.key, k_BxTxKxH, positions_BxT),
                    _put(cache.value, v_BxTxKxH, positions_BxT))


class Mlp(nn.Module):
  """Position-wise feed-forward layer: d_model -> mlp_dim -> d_model."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD: Array) -> Array:
    config = self.config
    hidden_BxTxM = activations.hidden(
        config.mlp_activation,
        lambda name: _dense(config.mlp_dim, ('embed', 'mlp'), config, name)(
            x_BxTxD))
    return _dense(x_BxTxD.shape[-1], ('mlp', 'embed'), config, 'wo',
                  zero_init=config.zero_init_outputs)(hidden_BxTxM)


def make_norm(config: ModelConfig, kind: str | None = None,
              axis: str = 'embed') -> nn.Module:
  """LayerNorm or RMSNorm as `kind` (default: `config.norm`) says, over
  the last dim (logical axis `axis`), statistics in float32."""
  scale_init = undecayed(nn.initializers.ones, (axis,))
  common = dict(dtype=config.compute_dtype, param_dtype=config.weight_dtype,
                scale_init=scale_init, epsilon=config.norm_epsilon)
  if (kind or config.norm) == 'rmsnorm':
    return nn.RMSNorm(**common)
  return nn.LayerNorm(
      bias_init=undecayed(nn.initializers.zeros, (axis,)), **common)
