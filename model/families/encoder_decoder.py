"""`encoder_decoder`: the Transformer of Vaswani et al. 2017, an encoder and
a decoder that cross-attends to its output. Source and target share one
vocabulary."""

import flax.linen as nn
import jax

from model.blocks import BlockInputs, TransformerStack
from model.config import ModelConfig
from model.embedder import Embedder, default_positions, output, padding_mask
from model.families.family import Family
from model.positions import SCHEMES, random_positions
from model.readout import Readout
from model.state import Cache, KeysValues

Array = jax.Array


class EncoderDecoder(nn.Module):
  """Source tokens [B, S] and decoder inputs [B, T] (the targets shifted
  right, a start token first) to target logits, float32 [B, T, V]."""

  config: ModelConfig

  def setup(self):
    self.embedder = Embedder(self.config)
    self.encoder = TransformerStack(self.config, causal=False, cross=False)
    self.decoder = TransformerStack(self.config, causal=True, cross=True)

  def encode(self, inputs_BxS: Array, positions_BxS: Array | None = None,
             *, deterministic: bool = True) -> Array:
    """Encoder output [B, S, D] for source tokens [B, S] at
    `positions_BxS` (default 0..S-1)."""
    if positions_BxS is None:
      positions_BxS = default_positions(inputs_BxS)
    x_BxSxD = self.embedder(inputs_BxS, positions_BxS,
                            deterministic=deterministic)
    x_BxSxD, _ = self.encoder(x_BxSxD, BlockInputs(
        positions_BxS, padding_mask(inputs_BxS),
        deterministic=deterministic))
    return x_BxSxD

  def decode(self, encoded_BxSxD: Array | None, inputs_BxS: Array,
             decoder_inputs_BxT: Array, positions_BxT: Array | None = None,
             *, cache: Cache | None = None, deterministic: bool = True,
             readout: bool = False
             ) -> tuple[Array | Readout, Cache | None]:
    """(target logits [B, T, V] (with `readout`, their `Readout`), the
    cache after them or None), given the encoder output; `inputs_BxS`
    supplies the source padding mask.

    With a `cache` (see `start_decoding`), the tokens are read at
    `positions_BxT` after those its self-attention half holds; where its
    cross-attention half holds the source's keys and values, the encoder
    output is not read (pass None) and the tokens may be `copies`
    consecutive rows per source (see MultiHeadAttention).
    """
    if positions_BxT is None:
      positions_BxT = default_positions(decoder_inputs_BxT)
    y_BxTxD = self.embedder(decoder_inputs_BxT, positions_BxT,
                            deterministic=deterministic)
    y_BxTxD, cache = self.decoder(y_BxTxD, BlockInputs(
        positions_BxT, encoded_BxSxD=encoded_BxSxD,
        cross_mask=padding_mask(inputs_BxS), deterministic=deterministic),
                                  cache=cache)
    return output(self.embedder, y_BxTxD, readout), cache

  def __call__(self, inputs_BxS: Array, decoder_inputs_BxT: Array, *,
               deterministic: bool = True, readout: bool = False
               ) -> tuple[Array | Readout, None]:
    """(target logits or their `Readout`, no state). In training, a
    randomized position scheme's positions are drawn once per example
    (from the 'dropout' random stream) and shared: source and target token
    i read the same position, as they read position i otherwise."""
    source_positions = target_positions = None
    if SCHEMES[self.config.position].randomized and not deterministic:
      (batch, source_len), target_len = (inputs_BxS.shape,
                                         decoder_inputs_BxT.shape[1])
      shared_BxL = random_positions(
          self.make_rng('dropout'), batch, max(source_len, target_len),
          self.config.max_len)
      source_positions = shared_BxL[:, :source_len]
      target_positions = shared_BxL[:, :target_len]
    encoded_BxSxD = self.encode(inputs_BxS, source_positions,
                                deterministic=deterministic)
    return self.decode(encoded_BxSxD, inputs_BxS, decoder_inputs_BxT,
                       target_positions, deterministic=deterministic,
                       readout=readout)

  def start_decoding(self, inputs_BxS: Array, length: int
                     ) -> tuple[tuple[KeysValues, ...], Cache]:
    """(every decoder layer's cross-attention keys and values of the
    encoded sources, projected once; an empty self-attention cache for
    `length` positions)."""
    sources = self.decoder.source_keys_values(self.encode(inputs_BxS))
    return sources, Cache.empty(self.config, inputs_BxS.shape[0], length)

  def decoding_step(self, sources: tuple[KeysValues, ...], inputs_BxS: Array,
                    tokens_BxT: Array, positions_BxT: Array, cache: Cache
                    ) -> tuple[Array, Cache]:
    """(logits [B, T, V], the self-attention cache after `tokens_BxT`);
    the rows may be `copies` consecutive rows per source, which read the
    `sources` of `start_decoding` without copying them."""
    logits_BxTxV, cache = self.decode(
        None, inputs_BxS, tokens_BxT, positions_BxT,
        cache=cache.replace(cross_attention=sources))
    return logits_BxTxV, cache.replace(cross_attention=None)


FAMILY = Family(
    name='encoder_decoder', module=EncoderDecoder, tasks=('seq2seq',),
    # The encoder's self-attention, the decoder's and its cross-attention.
    attention_layers=lambda config: 3 * config.num_layers,
    inputs_method='encode',
    random_positions=True)
