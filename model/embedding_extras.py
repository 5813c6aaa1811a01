"""What the speedrun records add around a decoder's token embedding: smear
(config.model.smear) and value embeddings (config.model.value_embeddings).
U-net skips live with the stack (model/blocks.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention.core import logical_axes
from model.config import ModelConfig
from model.weight_decay import undecayed

Array = jax.Array

# Smear's gate reads this many leading channels of a token's embedding
# (modded-nanogpt's choice).
SMEAR_GATE_WIDTH = 12


class Smear(nn.Module):
  """x_t + lambda * sigmoid(w . x_t[:12]) * x_{t-1}, x_{t-1} the embedding
  at the position before t's in its document (none at position 0, where
  packed rows start each document); lambda and w start at zero, so the
  layer starts as the identity."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD: Array, positions_BxT: Array,
               written_BxCxD: Array | None = None
               ) -> tuple[Array, Array | None]:
    """(the smeared embeddings [B, T, D], `written_BxCxD` with this call's
    embeddings at their positions). Without `written_BxCxD` (the
    embeddings a decoding cache holds by position), a row's predecessors
    are its own earlier columns, and its first is mixed with nothing."""
    config = self.config
    width = min(SMEAR_GATE_WIDTH, config.d_model)
    gate_w = self.param('gate', nn.with_logical_partitioning(
        nn.initializers.zeros, (None,)), (width,), config.weight_dtype)
    gain = self.param('gain', undecayed(nn.initializers.zeros, (None,)),
                      (1,), config.weight_dtype)
    dtype = x_BxTxD.dtype
    has_BxT = positions_BxT > 0
    if written_BxCxD is None:
      predecessor_BxTxD = jnp.concatenate(
          [jnp.zeros_like(x_BxTxD[:, :1]), x_BxTxD[:, :-1]], axis=1)
      has_BxT = has_BxT.at[:, 0].set(False)
    else:
      rows_BxT = jnp.broadcast_to(
          jnp.arange(positions_BxT.shape[0])[:, None], positions_BxT.shape)
      written_BxCxD = written_BxCxD.at[rows_BxT, positions_BxT].set(
          x_BxTxD.astype(written_BxCxD.dtype))
      predecessor_BxTxD = written_BxCxD[
          rows_BxT, jnp.maximum(positions_BxT - 1, 0)].astype(dtype)
    gate_BxT = gain.astype(dtype) * jax.nn.sigmoid(
        x_BxTxD[..., :width] @ gate_w.astype(dtype))
    gate_BxT = jnp.where(has_BxT, gate_BxT, 0).astype(dtype)
    return x_BxTxD + gate_BxT[..., None] * predecessor_BxTxD, written_BxCxD


class ValueEmbeddings(nn.Module):
  """config.value_embeddings token tables of the values' width, [V, K, H]
  each: their rows of the tokens, one array per table."""

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens_BxT: Array) -> tuple[Array, ...]:
    config = self.config
    tables = []
    for index in range(config.value_embeddings):
      table_VxKxH = self.param(
          f'table_{index}', nn.with_logical_partitioning(
              nn.initializers.normal(stddev=config.embedding_init_stddev),
              ('vocab', logical_axes.KV_HEADS, 'kv')),
          (config.vocab_size, config.num_kv_heads, config.head_dim),
          config.weight_dtype)
      # The whole table, as the token embedding's lookup reads it.
      table_VxKxH = nn.with_logical_constraint(table_VxKxH,
                                               (None, None, None))
      tables.append(jnp.take(table_VxKxH, tokens_BxT, axis=0).astype(
          config.compute_dtype))
    return tuple(tables)
