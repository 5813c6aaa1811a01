"""Transformer blocks and stacks of them."""

import flax.linen as nn
import jax

from model.config import ModelConfig
from model.layers import MultiHeadAttention, Mlp, make_norm

Array = jax.Array


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

  def _residual(self, x_BxTxD: Array, sublayer, name: str,
                deterministic: bool) -> Array:
    dropout = nn.Dropout(self.config.dropout_rate)
    if self.config.norm_position == 'pre':
      update = sublayer(make_norm(self.config, f'{name}_norm')(x_BxTxD))
      return x_BxTxD + dropout(update, deterministic=deterministic)
    update = dropout(sublayer(x_BxTxD), deterministic=deterministic)
    return make_norm(self.config, f'{name}_norm')(x_BxTxD + update)

  # Arguments are positional so that nn.remat can mark `deterministic` static.
  @nn.compact
  def __call__(self, x_BxTxD: Array, self_mask: Array | None,
               encoded_BxSxD: Array | None, cross_mask: Array | None,
               positions_BxT: Array, deterministic: bool) -> Array:
    config = self.config
    self_attention = MultiHeadAttention(config, name='self_attention')
    x_BxTxD = self._residual(
        x_BxTxD,
        lambda y: self_attention(y, y, mask=self_mask, is_causal=self.causal,
                                 q_positions_BxT=positions_BxT,
                                 kv_positions_BxS=positions_BxT,
                                 deterministic=deterministic),
        'self_attention', deterministic)
    if self.cross:
      cross_attention = MultiHeadAttention(config, cross=True,
                                           name='cross_attention')
      x_BxTxD = self._residual(
          x_BxTxD,
          lambda y: cross_attention(y, encoded_BxSxD, mask=cross_mask,
                                    deterministic=deterministic),
          'cross_attention', deterministic)
    return self._residual(x_BxTxD, Mlp(config, name='mlp'), 'mlp',
                          deterministic)


class TransformerStack(nn.Module):
  """`config.num_layers` blocks, plus the final norm that pre-norm needs."""

  config: ModelConfig
  causal: bool
  cross: bool

  @nn.compact
  def __call__(self, x_BxTxD: Array, positions_BxT: Array, *,
               self_mask: Array | None = None,
               encoded_BxSxD: Array | None = None,
               cross_mask: Array | None = None,
               deterministic: bool = True) -> Array:
    """`positions_BxT` are each token's position, for relative schemes."""
    block_cls = TransformerBlock
    if self.config.remat:
      # Index 6 is `deterministic`, counting `self` as 0.
      block_cls = nn.remat(TransformerBlock, static_argnums=(6,))
    for layer in range(self.config.num_layers):
      x_BxTxD = block_cls(self.config, self.causal, self.cross,
                          name=f'block_{layer}')(
                              x_BxTxD, self_mask, encoded_BxSxD, cross_mask,
                              positions_BxT, deterministic)
    if self.config.norm_position == 'pre':
      x_BxTxD = make_norm(self.config, 'final_norm')(x_BxTxD)
    return x_BxTxD
