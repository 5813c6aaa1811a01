"""Transformer blocks and stacks of them."""

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention.core import logical_axes
from model.config import ModelConfig
from model.layers import MultiHeadAttention, Mlp, make_norm
from model.moe import MoeMlp
from model.state import Cache, KeysValues, LatentCache, RecurrentState
from model.weight_decay import undecayed

Array = jax.Array
# One self-attention layer's decoding cache.
LayerCache = KeysValues | RecurrentState | LatentCache

# What config.model.remat keeps of a block for the backward pass: nothing
# but its inputs (None: jax.checkpoint's default), or the matmul outputs.
REMAT_POLICY = {'full': None,
                'dots_saveable': jax.checkpoint_policies.dots_saveable}


@flax.struct.dataclass
class BlockInputs:
  """What every block of a stack reads besides its input [B, T, D]."""

  # Each token's position [B, T], for relative schemes.
  positions_BxT: Array
  # Self-attention's mask: broadcastable to [B, N, T, S], or an
  # attention.SegmentMask; None for none.
  self_mask: Any = None
  # The encoder's output [B, S, D] that cross-attention reads (None when a
  # cache holds its keys and values), and its mask.
  encoded_BxSxD: Array | None = None
  cross_mask: Array | None = None
  # The positions [B, M] of a Transformer-XL memory's hidden states.
  memory_positions_BxM: Array | None = None
  # No dropout. Static (part of the tree's structure), so that remat needs
  # no static argument.
  deterministic: bool = flax.struct.field(pytree_node=False, default=True)


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
  # Self-attention mixes its values with the first block's
  # (config.value_residual).
  mixes_values: bool = False
  # Self-attention adds a value embedding to its values
  # (config.value_embeddings).
  adds_value_embedding: bool = False

  def setup(self):
    config = self.config
    self.self_attention_norm = make_norm(config)
    self.self_attention = MultiHeadAttention(
        config, causal=self.causal, mixes_values=self.mixes_values,
        adds_value_embedding=self.adds_value_embedding)
    if self.cross:
      self.cross_attention_norm = make_norm(config)
      self.cross_attention = MultiHeadAttention(config, cross=True)
    self.mlp_norm = make_norm(config)
    self.feed_forward = (MoeMlp(config, name='moe') if self.moe
                         else Mlp(config, name='mlp'))
    # A dropout layer per residual, in order, named as flax names layers
    # made inline, so that a seed draws the masks it always drew.
    self.dropouts = [nn.Dropout(config.dropout_rate, name=f'Dropout_{i}')
                     for i in range(3 if self.cross else 2)]

  def _add(self, x_BxTxD: Array, update_BxTxD: Array, norm: nn.Module,
           dropout: nn.Module, deterministic: bool) -> Array:
    """The residual connection, normalised after it for post-norm."""
    update_BxTxD = dropout(update_BxTxD, deterministic=deterministic)
    if self.config.norm_position == 'pre':
      return x_BxTxD + update_BxTxD
    return norm(x_BxTxD + update_BxTxD)

  def _normed(self, x_BxTxD: Array, norm: nn.Module) -> Array:
    """A sublayer's input: normalised first for pre-norm."""
    return norm(x_BxTxD) if self.config.norm_position == 'pre' else x_BxTxD

  def __call__(self, x_BxTxD: Array, inputs: BlockInputs,
               memory_BxMxD: Array | None = None,
               cache: LayerCache | None = None,
               source: KeysValues | None = None,
               first_values_BxSxKxH: Array | None = None,
               value_embedding_BxTxKxH: Array | None = None
               ) -> tuple[Array, LayerCache | None, Array]:
    """(output [B, T, D], self-attention's cache after it or None, the
    values self-attention attended with for this call's positions).

    With `memory_BxMxD` (earlier hidden states entering this block, at
    `inputs.memory_positions_BxM`), self-attention reads them as keys and
    values before the current positions. With a `cache` (see
    MultiHeadAttention) self-attention reads and writes it, and
    cross-attention reads the source's keys and values from `source`. A
    block that `mixes_values` mixes its values with `first_values_BxSxKxH`
    (the first block's); one that `adds_value_embedding` adds
    `value_embedding_BxTxKxH` (its table's rows of the tokens) to them.
    """
    norm = self.self_attention_norm
    queries_BxTxD = self._normed(x_BxTxD, norm)
    context_BxSxD, kv_positions_BxS = queries_BxTxD, inputs.positions_BxT
    if memory_BxMxD is not None:
      context_BxSxD = self._normed(jnp.concatenate(
          [memory_BxMxD.astype(x_BxTxD.dtype), x_BxTxD], axis=1), norm)
      kv_positions_BxS = jnp.concatenate(
          [inputs.memory_positions_BxM, inputs.positions_BxT], axis=1)
    update, cache, values_BxSxKxH = self.self_attention(
        queries_BxTxD, context_BxSxD, mask=inputs.self_mask,
        q_positions_BxT=inputs.positions_BxT,
        kv_positions_BxS=kv_positions_BxS, cache=cache,
        first_values_BxSxKxH=first_values_BxSxKxH,
        value_embedding_BxSxKxH=value_embedding_BxTxKxH,
        deterministic=inputs.deterministic)
    x_BxTxD = self._add(x_BxTxD, update, norm, self.dropouts[0],
                        inputs.deterministic)
    if self.cross:
      norm = self.cross_attention_norm
      update, _, _ = self.cross_attention(
          self._normed(x_BxTxD, norm), inputs.encoded_BxSxD,
          mask=inputs.cross_mask, cache=source,
          deterministic=inputs.deterministic)
      x_BxTxD = self._add(x_BxTxD, update, norm, self.dropouts[1],
                          inputs.deterministic)
    update = self.feed_forward(self._normed(x_BxTxD, self.mlp_norm))
    return self._add(x_BxTxD, update, self.mlp_norm, self.dropouts[-1],
                     inputs.deterministic), cache, values_BxSxKxH

  def source_keys_values(self, encoded_BxSxD: Array) -> KeysValues:
    """Cross-attention's keys and values of the encoder output."""
    return self.cross_attention.source_keys_values(encoded_BxSxD)


def _block_class(config: ModelConfig, scanned: bool) -> type[nn.Module]:
  """TransformerBlock, under config.remat's policy.

  In scan_layers' loop, 'none' keeps the matmul outputs (dots_saveable):
  the loop stores every intermediate that its backward pass reads, each
  elementwise result among them, where the compiled step of blocks one by
  one fuses those into their readers (keeping them all made a step 12-18%
  slower than blocks one by one, 8 layers of bench_train's small shape on
  2 CPU cores, against 1-10% with dots_saveable). Nor does the loop
  need remat's barrier against XLA merging the recomputation into the
  forward pass (flax's advice for remat inside scan)."""
  policy = config.remat
  if scanned and policy == 'none':
    policy = 'dots_saveable'
  if policy == 'none':
    return TransformerBlock
  return nn.remat(TransformerBlock, policy=REMAT_POLICY[policy],
                  prevent_cse=not scanned)


def _block(config: ModelConfig, causal: bool, cross: bool, layer: int,
           name: str, scanned: bool = False) -> nn.Module:
  """Block `layer` of a stack: its attention (`config.for_layer`), its
  feed-forward layer, whether it mixes the first block's values and
  whether it adds a value embedding."""
  return _block_class(config, scanned)(
      config.for_layer(layer), causal, cross, config.has_moe(layer),
      config.value_residual and layer > 0,
      config.value_embedding_table(layer) is not None, name=name)


def _run(blocks, x_BxTxD: Array, inputs: BlockInputs,
         memory_LxBxMxD: Array | None, caches, sources,
         first_values_BxSxKxH: Array | None, value_embeddings=None,
         unet_weights: Array | None = None):
  """`blocks` in turn: (output, each block's input, each block's cache
  after it, the values later blocks mix with: `first_values_BxSxKxH`, or
  where None, the first block's). `memory_LxBxMxD`, `caches`, `sources`
  and `value_embeddings` hold an entry per block, or are None. With
  `unet_weights` [L // 2], block L - 1 - i also reads block i's output
  times weight i (U-net skips)."""
  block_inputs, new_caches, skips = [], [], []
  skipped = 0 if unet_weights is None else unet_weights.shape[0]
  for index, block in enumerate(blocks):
    mirror = len(blocks) - 1 - index
    if mirror < skipped:
      x_BxTxD = x_BxTxD + unet_weights[mirror].astype(
          x_BxTxD.dtype) * skips[mirror]
    # Under a mesh with logical axis rules, each block's input is laid out
    # as the rules say (e.g. split by example and along the length);
    # elsewhere this does nothing.
    x_BxTxD = nn.with_logical_constraint(x_BxTxD, logical_axes.ACTIVATIONS)
    block_inputs.append(x_BxTxD)
    x_BxTxD, cache, values_BxSxKxH = block(
        x_BxTxD, inputs,
        None if memory_LxBxMxD is None else memory_LxBxMxD[index],
        None if caches is None else caches[index],
        None if sources is None else sources[index], first_values_BxSxKxH,
        None if value_embeddings is None else value_embeddings[index])
    if index < skipped:
      skips.append(x_BxTxD)
    new_caches.append(cache)
    if first_values_BxSxKxH is None:
      first_values_BxSxKxH = values_BxSxKxH
  return x_BxTxD, block_inputs, new_caches, first_values_BxSxKxH


def _unmarked(cache: LayerCache | None) -> LayerCache | None:
  """One block's cache as the loop slices it from stacked ones: no longer
  stacked."""
  return None if cache is None else cache.replace(stacked=False)


def _group_of(stacked: LayerCache, group: Array) -> LayerCache:
  """Group `group`'s entry of a stacked cache (keys and values, or a
  recurrent state)."""
  take = lambda x: jax.lax.dynamic_index_in_dim(x, group, keepdims=False)
  return jax.tree.map(take, stacked).replace(stacked=False)


def _written(stacked: LayerCache, entry: LayerCache,
             group: Array) -> LayerCache:
  """A stacked cache with group `group`'s entry replaced."""
  put = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, group, 0)
  return jax.tree.map(put, stacked, entry.replace(stacked=True))


class BlockGroup(nn.Module):
  """`config.scan_group` consecutive blocks after the first
  `config.scan_start`: what each step of scan_layers' loop runs. Any group
  of them has the same attentions and feed-forward layers, as the pattern
  and the MoE layers repeat over it."""

  config: ModelConfig
  causal: bool
  cross: bool

  def setup(self):
    config = self.config
    self.blocks = [_block(config, self.causal, self.cross,
                          config.scan_start + j, f'block_{j}', scanned=True)
                   for j in range(config.scan_group)]

  def __call__(self, carry: tuple, inputs: BlockInputs,
               first_values_BxSxKxH: Array | None, per_group: tuple):
    """((output, caches, the next group's index), each block's input
    [G, B, T, D] with a memory, else None). `carry`: (input [B, T, D], the
    stacked caches of the G blocks or None, this group's index);
    `per_group`: this group's (memory [G, B, M, D], sources), each None or
    G blocks'. The caches are carried whole, each block reading and
    writing its group's entry, so that a decoding step updates them in
    place rather than building new stacked arrays."""
    x_BxTxD, caches, group = carry
    memory_GxBxMxD, sources = per_group
    x_BxTxD, block_inputs, new_caches, _ = _run(
        self.blocks, x_BxTxD, inputs, memory_GxBxMxD,
        caches and [_group_of(cache, group) for cache in caches],
        sources and [_unmarked(source) for source in sources],
        first_values_BxSxKxH)
    if caches is not None:
      caches = tuple(_written(cache, new, group)
                     for cache, new in zip(caches, new_caches))
    return ((x_BxTxD, caches, group + 1),
            None if memory_GxBxMxD is None else jnp.stack(block_inputs))

  def source_keys_values(self, carry: None, encoded_BxSxD: Array
                         ) -> tuple[None, tuple[KeysValues, ...]]:
    """The group's cross-attention keys and values of the encoder output,
    as a step of the loop returns them."""
    return carry, tuple(block.source_keys_values(encoded_BxSxD)
                        for block in self.blocks)


def _scanned_groups(config: ModelConfig) -> type[nn.Module]:
  """BlockGroup run as a loop over the groups: parameters (and what the
  blocks sow) stacked along a leading axis named logical_axes.LAYERS, a
  fresh random stream per group."""
  count = (config.num_layers - config.scan_start) // config.scan_group
  common = dict(variable_axes={'params': 0, 'intermediates': 0, 'moe': 0},
                split_rngs={'params': True, 'dropout': True}, length=count,
                metadata_params={nn.PARTITION_NAME: logical_axes.LAYERS})
  return nn.scan(BlockGroup, methods={
      '__call__': dict(common, in_axes=(nn.broadcast, nn.broadcast, 0)),
      'source_keys_values': dict(common, in_axes=(nn.broadcast,))})


class TransformerStack(nn.Module):
  """`config.num_layers` blocks, plus the final norm that pre-norm needs.
  Block i has the attention `config.for_layer(i)` gives (a pattern's
  entries cycled over the layers), and a mixture-of-experts feed-forward
  layer where `config.has_moe(i)`. Under `config.scan_layers`, the blocks
  after the first `config.scan_start` run as a loop over groups of them
  (model/layer_stack.py describes the layout)."""

  config: ModelConfig
  causal: bool
  cross: bool

  def setup(self):
    config = self.config
    one_by_one = (config.scan_start if config.scan_layers
                  else config.num_layers)
    self.blocks = [_block(config, self.causal, self.cross, layer,
                          f'block_{layer}') for layer in range(one_by_one)]
    if config.scan_layers:
      self.layers = _scanned_groups(config)(config, self.causal, self.cross)
    if config.unet_skips:  # Weight i: block i's output into L - 1 - i's.
      self.unet_weights = self.param(
          'unet_weights', undecayed(nn.initializers.ones, (None,)),
          (config.num_layers // 2,), config.weight_dtype)
    if config.norm_position == 'pre':
      self.final_norm = make_norm(config)

  def __call__(self, x_BxTxD: Array, inputs: BlockInputs, *,
               memory_LxBxMxD: Array | None = None,
               cache: Cache | None = None,
               value_embeddings: tuple[Array, ...] = ()):
    """(output [B, T, D], state): with a memory, the state is each block's
    input [L, B, T, D], from which the caller forms the next memory; with a
    `cache` (see model.state.Cache), the cache after this call; else None.
    `value_embeddings`: the tables' rows of the tokens [B, T, K, H]
    (config.value_embeddings), which config.value_embedding_table assigns
    to the layers.
    """
    config = self.config
    per_block = [None if config.value_embedding_table(layer) is None else
                 value_embeddings[config.value_embedding_table(layer)]
                 for layer in range(len(self.blocks))]
    x_BxTxD, block_inputs, self_caches, first_values_BxSxKxH = _run(
        self.blocks, x_BxTxD, inputs, memory_LxBxMxD,
        None if cache is None else cache.self_attention,
        None if cache is None else cache.cross_attention, None, per_block,
        self.unet_weights if config.unet_skips else None)
    if self.config.scan_layers:
      x_BxTxD, group_caches, inputs_NxGxBxTxD = self._loop(
          x_BxTxD, inputs, first_values_BxSxKxH, memory_LxBxMxD, cache)
      if memory_LxBxMxD is not None:
        block_inputs.extend(inputs_NxGxBxTxD.reshape(
            -1, *inputs_NxGxBxTxD.shape[2:]))
      if cache is not None:
        self_caches.extend(group_caches)
    if self.config.norm_position == 'pre':
      x_BxTxD = self.final_norm(x_BxTxD)
    if cache is not None:
      return x_BxTxD, cache.replace(self_attention=tuple(self_caches))
    if memory_LxBxMxD is not None:
      return x_BxTxD, jnp.stack(block_inputs)
    return x_BxTxD, None

  def _loop(self, x_BxTxD: Array, inputs: BlockInputs,
            first_values_BxSxKxH: Array | None,
            memory_LxBxMxD: Array | None, cache: Cache | None):
    """The scanned blocks: (output, their caches or None, their inputs
    [n, G, B, T, D] or None)."""
    start, group = self.config.scan_start, self.config.scan_group
    memory = None
    if memory_LxBxMxD is not None:
      memory = memory_LxBxMxD[start:].reshape(
          -1, group, *memory_LxBxMxD.shape[1:])
    caches = sources = None
    if cache is not None:
      caches = cache.self_attention[start:]
      if cache.cross_attention is not None:
        sources = cache.cross_attention[start:]
    (x_BxTxD, caches, _), inputs_NxGxBxTxD = self.layers(
        (x_BxTxD, caches, jnp.int32(0)), inputs, first_values_BxSxKxH,
        (memory, sources))
    return x_BxTxD, caches, inputs_NxGxBxTxD

  def source_keys_values(self, encoded_BxSxD: Array
                         ) -> tuple[KeysValues, ...]:
    """Every block's cross-attention keys and values of the encoder
    output: what decoding reads from the cache's cross-attention half."""
    sources = tuple(block.source_keys_values(encoded_BxSxD)
                    for block in self.blocks)
    if self.config.scan_layers:
      _, group_sources = self.layers.source_keys_values(None, encoded_BxSxD)
      sources += tuple(source.replace(stacked=True)
                       for source in group_sources)
    return sources
