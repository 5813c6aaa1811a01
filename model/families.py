"""The three Transformer families: DecoderLM, EncoderDecoder, EncoderClassifier.

Inputs are int token ids [B, T] with 0 as padding. Outputs (logits) are
float32 whatever `config.dtype` is.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import attention
from model import positions as positions_lib
from model.blocks import TransformerStack
from model.config import PAD_ID, ModelConfig
from model.readout import Readout
from model.rnn import RnnAttention
from model.weight_decay import undecayed

Array = jax.Array


def padding_mask(tokens_BxS: Array) -> Array:
  """[B, 1, 1, S] bool: True at keys that are real tokens (not padding)."""
  return (tokens_BxS != PAD_ID)[:, None, None, :]


def default_positions(tokens_BxT: Array) -> Array:
  """[B, T] positions 0..T-1 for every example."""
  return jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)


class Embedder(nn.Module):
  """Token embedding and position information in; vocabulary logits out.

  The output projection is the token embedding transposed when
  `config.tie_embeddings` (Press & Wolf 2017), else a projection of its own.
  """

  config: ModelConfig

  def setup(self):
    config = self.config
    self.token_embedding = nn.Embed(
        config.vocab_size, config.d_model, dtype=config.compute_dtype,
        param_dtype=config.weight_dtype,
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(stddev=1.0), ('vocab', 'embed')))
    if config.position == 'learned':
      self.learned_positions = positions_lib.LearnedPositions(
          config.max_len, config.d_model, config.weight_dtype)
    if not config.tie_embeddings:
      self.output_projection = OutputProjection(config)
    self.dropout = nn.Dropout(config.dropout_rate)

  def embed_tokens(self, tokens_BxT: Array) -> Array:
    """[B, T, D]. Under a mesh, the lookup reads the whole table (gathered,
    as FSDP does for any weight) and gives rows laid out like the blocks'
    inputs; a lookup in a split table would need a costly reshuffle."""
    table_VxD = nn.with_logical_constraint(
        self.token_embedding.embedding, (None, None))
    x_BxTxD = jnp.take(table_VxD, tokens_BxT, axis=0).astype(
        self.config.compute_dtype)
    return nn.with_logical_constraint(
        x_BxTxD, ('activation_batch', 'activation_length', 'activation_embed'))

  def add_positions(self, x_BxTxD: Array, positions_BxT: Array, *,
                    deterministic: bool) -> Array:
    """Adds position information, then applies embedding dropout."""
    config = self.config
    if config.position == 'learned':
      if x_BxTxD.shape[1] > config.max_len:
        raise ValueError(
            f'sequence length {x_BxTxD.shape[1]} (a classifier\'s CLS vector '
            'included) exceeds config.model.max_len='
            f'{config.max_len} of the learned positions.')
      x_BxTxD = x_BxTxD + self.learned_positions(positions_BxT)
    elif config.position == 'sinusoidal':
      x_BxTxD = x_BxTxD + positions_lib.sinusoidal(positions_BxT,
                                                   config.d_model)
    x_BxTxD = x_BxTxD.astype(config.compute_dtype)
    return self.dropout(x_BxTxD, deterministic=deterministic)

  def __call__(self, tokens_BxT: Array, positions_BxT: Array | None = None, *,
               deterministic: bool) -> Array:
    """Embeds tokens at `positions_BxT` (default 0..T-1), [B, T, D]."""
    if positions_BxT is None:
      positions_BxT = default_positions(tokens_BxT)
    return self.add_positions(self.embed_tokens(tokens_BxT), positions_BxT,
                              deterministic=deterministic)

  def readout(self, x_BxTxD: Array) -> Readout:
    """The logits of hidden states [B, T, D], not yet computed."""
    if self.config.tie_embeddings:
      # x E^T / sqrt(d): the embeddings are initialised with unit variance.
      return Readout(x_BxTxD, self.token_embedding.embedding,
                     weights_spec='vd',
                     divisor=float(np.sqrt(self.config.d_model)),
                     compute_dtype=self.config.compute_dtype)
    return self.output_projection(x_BxTxD)

  def logits(self, x_BxTxD: Array) -> Array:
    """Vocabulary logits, float32 [B, T, V]."""
    return self.readout(x_BxTxD).logits()


class OutputProjection(nn.Module):
  """An output projection of its own (untied embeddings): a kernel and a
  bias, read out as a `Readout`."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD: Array) -> Readout:
    config = self.config
    kernel_DxV = self.param('kernel', nn.with_logical_partitioning(
        nn.initializers.xavier_uniform(), ('embed', 'vocab')),
                            (config.d_model, config.vocab_size),
                            config.weight_dtype)
    bias_V = self.param('bias', undecayed(nn.initializers.zeros, ('vocab',)),
                        (config.vocab_size,), config.weight_dtype)
    return Readout(x_BxTxD, kernel_DxV, bias_V,
                   compute_dtype=config.compute_dtype)


def _output(embedder: Embedder, x_BxTxD: Array,
            readout: bool) -> Array | Readout:
  """The logits of the final hidden states, or with `readout` their
  `Readout`."""
  out = embedder.readout(x_BxTxD)
  return out if readout else out.logits()


def empty_memory(config: ModelConfig, batch_size: int) -> dict[str, Array]:
  """A Transformer-XL memory holding nothing yet: hidden [L, B, M, D] and
  valid [B, M] (False: not yet filled)."""
  length = config.memory_length
  return {'hidden': jnp.zeros((config.num_layers, batch_size, length,
                               config.d_model), config.compute_dtype),
          'valid': jnp.zeros((batch_size, length), bool)}


def init_cache(config: ModelConfig, batch_size: int,
               length: int) -> tuple[dict[str, Array], ...]:
  """An empty key/value cache for decoding up to `length` positions: each
  layer's self-attention keys and values, {'key', 'value'} [B, length, K,
  H] ([B, length, 1, D] without projections), in the compute dtype.
  Layers hold arrays of their own, so that a decoding step writes one
  position in place rather than copying a stacked cache."""
  shape = (batch_size, length, config.num_kv_heads, config.head_dim)
  if not config.attention_projections:  # The inputs themselves, one head.
    shape = (batch_size, length, 1, config.d_model)
  return tuple({'key': jnp.zeros(shape, config.compute_dtype),
                'value': jnp.zeros(shape, config.compute_dtype)}
               for _ in range(config.num_layers))


class DecoderLM(nn.Module):
  """A GPT-2-style causal language model (Radford et al. 2019), optionally
  with Transformer-XL's memory (Dai et al. 2019)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens_BxT: Array, positions_BxT: Array | None = None,
               segment_ids_BxT: Array | None = None,
               memory: dict[str, Array] | None = None, *,
               cache: tuple[dict[str, Array], ...] | None = None,
               deterministic: bool = True, readout: bool = False):
    """Next-token logits, float32 [B, T, V]; logits[:, t] sees tokens <= t.
    With `readout`, a `Readout` of them in their place, for a loss that
    computes them a block at a time.

    Rows packed with several sequences give each token's `segment_ids_BxT`
    (and its position within its sequence): tokens attend only within their
    own segment. With a `memory` (see `empty_memory`) of the hidden states
    before this segment, returns (logits, the memory after it): the last
    config.memory_length positions, with no gradient. With a `cache` (see
    `init_cache`), the tokens are read at `positions_BxT` after those the
    cache holds, and returns (logits, the cache with them).
    """
    if positions_BxT is None:
      positions_BxT = default_positions(tokens_BxT)
    embedder = Embedder(self.config, name='embedder')
    x_BxTxD = embedder(tokens_BxT, positions_BxT, deterministic=deterministic)
    # A zero-valued hook: the gradient with respect to the 'perturbations'
    # collection is d(loss)/d(embeddings); a no-op unless that is passed.
    x_BxTxD = self.perturb('embeddings', x_BxTxD)
    decoder = TransformerStack(self.config, causal=True, cross=False,
                               name='decoder')
    if cache is not None:
      x_BxTxD, cache = decoder(x_BxTxD, positions_BxT, cache=cache,
                               deterministic=deterministic)
      return embedder.logits(x_BxTxD), cache
    if memory is None:
      self_mask = None
      if segment_ids_BxT is not None:
        # Compared block by block where attention is: never [B, 1, T, T].
        self_mask = attention.SegmentMask(segment_ids_BxT)
      x_BxTxD = decoder(x_BxTxD, positions_BxT, self_mask=self_mask,
                        deterministic=deterministic)
      return _output(embedder, x_BxTxD, readout)
    if segment_ids_BxT is not None:
      raise ValueError('a Transformer-XL memory reads contiguous text, not '
                       'packed segments.')
    length = memory['valid'].shape[1]
    # The memory holds the positions just before the segment's first.
    memory_positions_BxM = (positions_BxT[:, :1] - length
                            + jnp.arange(length)[None])
    valid_BxS = jnp.concatenate(
        [memory['valid'], jnp.ones(tokens_BxT.shape, bool)], axis=1)
    x_BxTxD, inputs_LxBxTxD = decoder(
        x_BxTxD, positions_BxT, self_mask=valid_BxS[:, None, None, :],
        memory_LxBxMxD=memory['hidden'],
        memory_positions_BxM=memory_positions_BxM,
        deterministic=deterministic)
    hidden = jnp.concatenate(
        [memory['hidden'], inputs_LxBxTxD.astype(memory['hidden'].dtype)],
        axis=2)
    new_memory = jax.lax.stop_gradient({'hidden': hidden[:, :, -length:],
                                        'valid': valid_BxS[:, -length:]})
    return _output(embedder, x_BxTxD, readout), new_memory


class EncoderDecoder(nn.Module):
  """The Transformer of Vaswani et al. 2017: an encoder, and a decoder that
  cross-attends to its output. Source and target share one vocabulary.
  """

  config: ModelConfig

  def setup(self):
    self.embedder = Embedder(self.config)
    self.encoder = TransformerStack(self.config, causal=False, cross=False)
    self.decoder = TransformerStack(self.config, causal=True, cross=True)

  def encode(self, inputs_BxS: Array, *, deterministic: bool = True) -> Array:
    """Encoder output [B, S, D] for source tokens [B, S]."""
    x_BxSxD = self.embedder(inputs_BxS, deterministic=deterministic)
    return self.encoder(x_BxSxD, default_positions(inputs_BxS),
                        self_mask=padding_mask(inputs_BxS),
                        deterministic=deterministic)

  def decode(self, encoded_BxSxD: Array | None, inputs_BxS: Array,
             decoder_inputs_BxT: Array, positions_BxT: Array | None = None, *,
             cache: tuple[dict[str, Array], ...] | None = None,
             deterministic: bool = True, readout: bool = False):
    """Target logits, float32 [B, T, V], given the encoder output (with
    `readout`, their `Readout`).

    `decoder_inputs_BxT` are the targets shifted right (a start token first);
    `inputs_BxS` supplies the source padding mask. With a `cache` (see
    `init_cache`) of the decoder's self-attention, the tokens are read at
    `positions_BxT` after those it holds; returns (logits, cache), the
    cache holding also every layer's cross-attention keys and values of the
    source, {'cross_key', 'cross_value'} [B, S, K, H] per layer. Given those, the
    encoder output is not read (pass None) and the tokens may be `copies`
    consecutive rows per source (see MultiHeadAttention).
    """
    if positions_BxT is None:
      positions_BxT = default_positions(decoder_inputs_BxT)
    y_BxTxD = self.embedder(decoder_inputs_BxT, positions_BxT,
                            deterministic=deterministic)
    y_BxTxD = self.decoder(y_BxTxD, positions_BxT,
                           encoded_BxSxD=encoded_BxSxD,
                           cross_mask=padding_mask(inputs_BxS), cache=cache,
                           deterministic=deterministic)
    if cache is not None:
      y_BxTxD, cache = y_BxTxD
      return self.embedder.logits(y_BxTxD), cache
    return _output(self.embedder, y_BxTxD, readout)

  def __call__(self, inputs_BxS: Array, decoder_inputs_BxT: Array, *,
               deterministic: bool = True, readout: bool = False):
    encoded_BxSxD = self.encode(inputs_BxS, deterministic=deterministic)
    return self.decode(encoded_BxSxD, inputs_BxS, decoder_inputs_BxT,
                       deterministic=deterministic, readout=readout)


class EncoderClassifier(nn.Module):
  """An encoder with a classification head over a pooled representation.

  `config.pooling == 'cls'` prepends a learned vector (position 0) and
  classifies its output (Devlin et al. 2019); 'mean' averages the outputs at
  non-padding positions.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens_BxT: Array, *, deterministic: bool = True) -> Array:
    """Class logits, float32 [B, num_classes]."""
    config = self.config
    embedder = Embedder(config, name='embedder')
    x_BxTxD = embedder.embed_tokens(tokens_BxT)
    keys_valid_BxT = tokens_BxT != PAD_ID
    if config.pooling == 'cls':
      cls_D = self.param(
          'cls', nn.with_logical_partitioning(
              nn.initializers.normal(stddev=1.0), ('embed',)),
          (config.d_model,), config.weight_dtype)
      cls_Bx1xD = jnp.broadcast_to(cls_D.astype(x_BxTxD.dtype),
                                   (x_BxTxD.shape[0], 1, config.d_model))
      x_BxTxD = jnp.concatenate([cls_Bx1xD, x_BxTxD], axis=1)
      keys_valid_BxT = jnp.pad(keys_valid_BxT, ((0, 0), (1, 0)),
                               constant_values=True)
    positions_BxT = default_positions(keys_valid_BxT)
    x_BxTxD = embedder.add_positions(x_BxTxD, positions_BxT,
                                     deterministic=deterministic)
    x_BxTxD = TransformerStack(config, causal=False, cross=False,
                               name='encoder')(
                                   x_BxTxD, positions_BxT,
                                   self_mask=keys_valid_BxT[:, None, None, :],
                                   deterministic=deterministic)
    x_BxTxD = x_BxTxD.astype(jnp.float32)  # The head computes in float32.
    if config.pooling == 'cls':
      pooled_BxD = x_BxTxD[:, 0]
    else:
      weights_BxTx1 = keys_valid_BxT[..., None].astype(jnp.float32)
      pooled_BxD = (jnp.sum(x_BxTxD * weights_BxTx1, axis=1)
                    / jnp.maximum(jnp.sum(weights_BxTx1, axis=1), 1.0))
    classifier = nn.DenseGeneral(
        config.num_classes, dtype=jnp.float32,
        param_dtype=config.weight_dtype, name='classifier',
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.xavier_uniform(), ('embed', None)),
        bias_init=undecayed(nn.initializers.zeros, (None,)))
    return classifier(pooled_BxD)


FAMILY_CLASSES = {
    'decoder_lm': DecoderLM,
    'encoder_decoder': EncoderDecoder,
    'encoder_classifier': EncoderClassifier,
    'rnn_attention': RnnAttention,
}


def build(config: ModelConfig) -> nn.Module:
  """The model of family `config.family`."""
  return FAMILY_CLASSES[config.family](config)
