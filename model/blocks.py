"""Transformer blocks and stacks of them."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.layers import MultiHeadAttention, Mlp, make_norm
from model.moe import MoeMlp

Array = jax.Array

# What config.model.remat keeps of a block for the backward pass: nothing
# but its inputs (None: jax.checkpoint's default), or the matmul outputs.
REMAT_POLICY = {'full': None,
                'dots_saveable': jax.checkpoint_policies.dots_saveable}


class TransformerBlock(nn.Module):
  """Self-attention, then cross-attention if `cross`, then feed-forward.

  Each sublayer f is residual: x + dropout(f(norm(x))) when
  `config.norm_position == 'pre'`, norm(x + dropout(f(x))) when 'post'.
  """

  config: ModelConfig
  # Self-attention is causal (decoders) rather than bidirectional (encoders).
  causal: bool
  # A cross-attention sublayer reads the encoder output (encoder-decoder).
  cross: bool
  # The feed-forward sublayer is a mixture of experts (config.moe).
  moe: bool = False

  def _add(self, x_BxTxD: Array, update_BxTxD: Array, norm: nn.Module,
           deterministic: bool) -> Array:
    """The residual connection, normalised after it for post-norm."""
    update_BxTxD = nn.Dropout(self.config.dropout_rate)(
        update_BxTxD, deterministic=deterministic)
    if self.config.norm_position == 'pre':
      return x_BxTxD + update_BxTxD
    return norm(x_BxTxD + update_BxTxD)

  def _residual(self, x_BxTxD: Array, sublayer, name: str,
                deterministic: bool) -> Array:
    norm = make_norm(self.config, f'{name}_norm')
    pre = self.config.norm_position == 'pre'
    update = sublayer(norm(x_BxTxD) if pre else x_BxTxD)
    return self._add(x_BxTxD, update, norm, deterministic)

  # Arguments are positional so that nn.remat can mark `deterministic` static.
  @nn.compact
  def __call__(self, x_BxTxD: Array, self_mask: Array | None,
               encoded_BxSxD: Array | None, cross_mask: Array | None,
               positions_BxT: Array, memory_BxMxD: Array | None,
               memory_positions_BxM: Array | None,
               cache: dict[str, Array] | None, deterministic: bool):
    """With `memory_BxMxD` (earlier hidden states entering this block, at
    `memory_positions_BxM`), self-attention reads them as keys and values
    before the current positions. With a `cache` (see MultiHeadAttention):
    self-attention's {'key', 'value'} and, in a decoder with
    cross-attention, the source's {'cross_key', 'cross_value'} once a call
    has projected them; returns (output, cache with both)."""
    config = self.config
    norm = make_norm(config, 'self_attention_norm')
    pre = config.norm_position == 'pre'
    queries_BxTxD = norm(x_BxTxD) if pre else x_BxTxD
    context_BxSxD, kv_positions_BxS = queries_BxTxD, positions_BxT
    if memory_BxMxD is not None:
      context_BxSxD = jnp.concatenate(
          [memory_BxMxD.astype(x_BxTxD.dtype), x_BxTxD], axis=1)
      context_BxSxD = norm(context_BxSxD) if pre else context_BxSxD
      kv_positions_BxS = jnp.concatenate(
          [memory_positions_BxM, positions_BxT], axis=1)
    self_cache = cross_cache = None
    if cache is not None:
      self_cache = {'key': cache['key'], 'value': cache['value']}
      cross_cache = ({'key': cache['cross_key'], 'value': cache['cross_value']}
                     if 'cross_key' in cache else {})
    update = MultiHeadAttention(config, name='self_attention')(
        queries_BxTxD, context_BxSxD, mask=self_mask, is_causal=self.causal,
        q_positions_BxT=positions_BxT, kv_positions_BxS=kv_positions_BxS,
        cache=self_cache, deterministic=deterministic)
    if cache is not None:
      update, cache = update
    x_BxTxD = self._add(x_BxTxD, update, norm, deterministic)
    if self.cross:
      norm = make_norm(config, 'cross_attention_norm')
      update = MultiHeadAttention(config, cross=True, name='cross_attention')(
          norm(x_BxTxD) if pre else x_BxTxD, encoded_BxSxD, mask=cross_mask,
          cache=cross_cache, deterministic=deterministic)
      if cache is not None:
        update, source = update
        cache |= {'cross_key': source['key'], 'cross_value': source['value']}
      x_BxTxD = self._add(x_BxTxD, update, norm, deterministic)
    mlp = MoeMlp(config, name='moe') if self.moe else Mlp(config, name='mlp')
    x_BxTxD = self._residual(x_BxTxD, mlp, 'mlp', deterministic)
    return x_BxTxD if cache is None else (x_BxTxD, cache)


class TransformerStack(nn.Module):
  """`config.num_layers` blocks, plus the final norm that pre-norm needs.
  Block i has the attention `config.for_layer(i)` gives (a pattern's
  entries cycled over the layers), and a mixture-of-experts feed-forward
  layer where `config.has_moe(i)`."""

  config: ModelConfig
  causal: bool
  cross: bool

  @nn.compact
  def __call__(self, x_BxTxD: Array, positions_BxT: Array, *,
               self_mask: Array | None = None,
               encoded_BxSxD: Array | None = None,
               cross_mask: Array | None = None,
               memory_LxBxMxD: Array | None = None,
               memory_positions_BxM: Array | None = None,
               cache: tuple[dict[str, Array], ...] | None = None,
               deterministic: bool = True):
    """The output [B, T, D]; with a memory, also each block's input
    [L, B, T, D], from which the caller forms the next memory; with a
    `cache` (each layer's, see TransformerBlock), also the cache after this
    call.

    `positions_BxT` are each token's position, for relative schemes.
    """
    block_cls = TransformerBlock
    if self.config.remat != 'none':
      # Index 9 is `deterministic`, counting `self` as 0.
      block_cls = nn.remat(TransformerBlock, static_argnums=(9,),
                           policy=REMAT_POLICY[self.config.remat])
    block_inputs, caches = [], []
    for layer in range(self.config.num_layers):
      # Under a mesh with logical axis rules, each block's input is laid out
      # as the rules say (e.g. split by example and along the length);
      # elsewhere this does nothing.
      x_BxTxD = nn.with_logical_constraint(
          x_BxTxD, ('activation_batch', 'activation_length',
                    'activation_embed'))
      block_inputs.append(x_BxTxD)
      memory_BxMxD = (None if memory_LxBxMxD is None
                      else memory_LxBxMxD[layer])
      layer_cache = None if cache is None else cache[layer]
      x_BxTxD = block_cls(self.config.for_layer(layer), self.causal,
                          self.cross, self.config.has_moe(layer),
                          name=f'block_{layer}')(
                              x_BxTxD, self_mask, encoded_BxSxD, cross_mask,
                              positions_BxT, memory_BxMxD,
                              memory_positions_BxM, layer_cache, deterministic)
      if cache is not None:
        x_BxTxD, layer_cache = x_BxTxD
        caches.append(layer_cache)
    if self.config.norm_position == 'pre':
      x_BxTxD = make_norm(self.config, 'final_norm')(x_BxTxD)
    if cache is not None:
      return x_BxTxD, tuple(caches)
    if memory_LxBxMxD is None:
      return x_BxTxD
    return x_BxTxD, jnp.stack(block_inputs)
