"""`decoder_lm`: a GPT-2-style causal language model (Radford et al. 2019),
optionally with Transformer-XL's memory (Dai et al. 2019)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import attention
from model.blocks import BlockInputs, TransformerStack
from model.config import ModelConfig
from model.embedder import Embedder, default_positions, output
from model.embedding_extras import Smear, ValueEmbeddings
from model.families.family import Family
from model.readout import Readout
from model.state import Cache, Memory

Array = jax.Array


class DecoderLM(nn.Module):
  """Tokens [B, T] to next-token logits, float32 [B, T, V]; logits[:, t]
  sees tokens <= t."""

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens_BxT: Array, positions_BxT: Array | None = None,
               segment_ids_BxT: Array | None = None, *,
               memory: Memory | None = None, cache: Cache | None = None,
               valid_BxT: Array | None = None, deterministic: bool = True,
               readout: bool = False
               ) -> tuple[Array | Readout, Memory | Cache | None]:
    """(logits, state). With `readout`, a `Readout` of the logits in their
    place, for a loss that computes them a block at a time.

    Rows packed with several sequences give each token's `segment_ids_BxT`
    (and its position within its sequence): tokens attend only within their
    own segment; the state is None. With a `memory` (Memory.empty to
    start) of the hidden states before this segment, the state is the
    memory after it: the last config.memory_length positions, with no
    gradient. With a `cache` (Cache.empty), the tokens are read at
    `positions_BxT` after those the cache holds, and the state is the cache
    with them; `valid_BxT`, False at the padding of right-padded prompts
    (None: none), keeps a recurrent state from reading it.
    """
    if positions_BxT is None:
      positions_BxT = default_positions(tokens_BxT)
    config = self.config
    embedder = Embedder(config, name='embedder')
    x_BxTxD = embedder(tokens_BxT, positions_BxT, deterministic=deterministic)
    # A zero-valued hook: the gradient with respect to the 'perturbations'
    # collection is d(loss)/d(embeddings); a no-op unless that is passed.
    x_BxTxD = self.perturb('embeddings', x_BxTxD)
    if config.smear:
      x_BxTxD, written_BxCxD = Smear(config, name='smear')(
          x_BxTxD, positions_BxT,
          None if cache is None else cache.embeddings)
    value_embeddings = ValueEmbeddings(config, name='value_embeddings')(
        tokens_BxT) if config.value_embeddings else ()
    decoder = TransformerStack(config, causal=True, cross=False,
                               name='decoder')
    if cache is not None:
      padding = None if valid_BxT is None else valid_BxT[:, None, None, :]
      x_BxTxD, cache = decoder(
          x_BxTxD, BlockInputs(positions_BxT, padding,
                               deterministic=deterministic),
          cache=cache, value_embeddings=value_embeddings)
      if config.smear:
        cache = cache.replace(embeddings=written_BxCxD)
      return output(embedder, x_BxTxD, readout), cache
    if memory is None:
      self_mask = None
      if segment_ids_BxT is not None:
        # Compared block by block where attention is: never [B, 1, T, T].
        # Its runs: the packed windows, then the padding after them.
        self_mask = attention.SegmentMask(
            segment_ids_BxT,
            max_segments=self.config.max_segments_per_row + 1)
      x_BxTxD, _ = decoder(x_BxTxD, BlockInputs(
          positions_BxT, self_mask, deterministic=deterministic),
                           value_embeddings=value_embeddings)
      return output(embedder, x_BxTxD, readout), None
    if segment_ids_BxT is not None:
      raise ValueError('a Transformer-XL memory reads contiguous text, not '
                       'packed segments.')
    length = memory.valid.shape[1]
    # The memory holds the positions just before the segment's first.
    memory_positions_BxM = (positions_BxT[:, :1] - length
                            + jnp.arange(length)[None])
    valid_BxS = jnp.concatenate(
        [memory.valid, jnp.ones(tokens_BxT.shape, bool)], axis=1)
    x_BxTxD, inputs_LxBxTxD = decoder(
        x_BxTxD, BlockInputs(positions_BxT, valid_BxS[:, None, None, :],
                             memory_positions_BxM=memory_positions_BxM,
                             deterministic=deterministic),
        memory_LxBxMxD=memory.hidden)
    hidden = jnp.concatenate(
        [memory.hidden, inputs_LxBxTxD.astype(memory.hidden.dtype)], axis=2)
    new_memory = jax.lax.stop_gradient(Memory(hidden[:, :, -length:],
                                              valid_BxS[:, -length:]))
    return output(embedder, x_BxTxD, readout), new_memory


FAMILY = Family(
    name='decoder_lm', module=DecoderLM, tasks=('lm', 'mqar'),
    attention_layers=lambda config: config.num_layers,
    memory=True, causal_stack=True)
