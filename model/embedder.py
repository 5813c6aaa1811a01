"""What every Transformer family reads tokens with and writes logits with:
the token embedding, absolute position information, and the output
projection (tied to the embedding or a projection of its own).
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import positions as positions_lib
from model.attention.core import logical_axes
from model.config import PAD_ID, ModelConfig
from model.readout import Readout
from model.weight_decay import undecayed

Array = jax.Array


def padding_mask(tokens_BxS: Array) -> Array:
  """[B, 1, 1, S] bool: True at keys that are real tokens (not padding)."""
  return (tokens_BxS != PAD_ID)[:, None, None, :]


def check_tokens(tokens_BxT: Array) -> None:
  """ValueError naming the tokens' shape unless it is [B, T] (chex, as the
  model is traced)."""
  chex.assert_rank(tokens_BxT, 2, exception_type=ValueError,
                   custom_message=f'tokens have shape {tokens_BxT.shape}; '
                   'expected rank 2 [batch, length].')


def default_positions(tokens_BxT: Array) -> Array:
  """[B, T] positions 0..T-1 for every example."""
  check_tokens(tokens_BxT)
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
            nn.initializers.normal(stddev=config.embedding_init_stddev),
            ('vocab', 'embed')))
    self.scheme = positions_lib.SCHEMES[config.position]
    self.position_embedding = (self.scheme.embedding(config)
                               if self.scheme.embedding else None)
    if not config.tie_embeddings:
      self.output_projection = OutputProjection(config)
    self.dropout = nn.Dropout(config.dropout_rate)

  def embed_tokens(self, tokens_BxT: Array) -> Array:
    """[B, T, D]. Under a mesh, the lookup reads the whole table (gathered,
    as FSDP does for any weight) and gives rows laid out like the blocks'
    inputs; a lookup in a split table would need a costly reshuffle."""
    check_tokens(tokens_BxT)
    table_VxD = nn.with_logical_constraint(
        self.token_embedding.embedding, (None, None))
    x_BxTxD = jnp.take(table_VxD, tokens_BxT, axis=0).astype(
        self.config.compute_dtype)
    return nn.with_logical_constraint(x_BxTxD, logical_axes.ACTIVATIONS)

  def add_positions(self, x_BxTxD: Array, positions_BxT: Array, *,
                    deterministic: bool) -> Array:
    """Adds position information, then applies embedding dropout."""
    chex.assert_shape(positions_BxT, x_BxTxD.shape[:2],
                      exception_type=ValueError,
                      custom_message=f'positions have shape '
                      f'{positions_BxT.shape}; expected the tokens\' '
                      f'[batch, length] = {x_BxTxD.shape[:2]}.')
    config = self.config
    limit = self.scheme.max_positions(config)
    if limit is not None and x_BxTxD.shape[1] > limit:
      raise ValueError(
          f'sequence length {x_BxTxD.shape[1]} (a classifier\'s CLS vector '
          f'included) exceeds config.model.max_len={limit}, the positions '
          f'config.model.position={config.position!r} represents.')
    if self.position_embedding:
      x_BxTxD = x_BxTxD + self.position_embedding(positions_BxT)
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
    config = self.config
    if config.tie_embeddings:
      # x E^T, over sqrt(d) for config.scale_tied_readout.
      return Readout(x_BxTxD, self.token_embedding.embedding,
                     weights_spec='vd',
                     divisor=(float(np.sqrt(config.d_model))
                              if config.scale_tied_readout else 1.0),
                     compute_dtype=config.compute_dtype,
                     cap=config.logit_softcap)
    return self.output_projection(x_BxTxD)

  def logits(self, x_BxTxD: Array) -> Array:
    """Vocabulary logits, float32 [B, T, V]."""
    return self.readout(x_BxTxD).logits()


class OutputProjection(nn.Module):
  """An output projection of its own (untied embeddings): a kernel and,
  where config.use_bias, a bias, read out as a `Readout`."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD: Array) -> Readout:
    config = self.config
    kernel_DxV = self.param('kernel', nn.with_logical_partitioning(
        nn.initializers.xavier_uniform(), ('embed', 'vocab')),
                            (config.d_model, config.vocab_size),
                            config.weight_dtype)
    bias_V = (self.param('bias', undecayed(nn.initializers.zeros,
                                           ('vocab',)),
                         (config.vocab_size,), config.weight_dtype)
              if config.use_bias else None)
    return Readout(x_BxTxD, kernel_DxV, bias_V,
                   compute_dtype=config.compute_dtype,
                   cap=config.logit_softcap)


def output(embedder: Embedder, x_BxTxD: Array,
           readout: bool) -> Array | Readout:
  """The logits of the final hidden states, or with `readout` their
  `Readout`."""
  out = embedder.readout(x_BxTxD)
  return out if readout else out.logits()
