"""What a model carries from one call to the next: a decoding cache and a
Transformer-XL memory. A model's forward call (`__call__`, and an
encoder-decoder's `decode`) returns `(output, state)`, the state one of
these or None.
"""

from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp

from model import attention, positions
from model.attention.variants import latent
from model.config import ModelConfig

Array = jax.Array


@flax.struct.dataclass
class KeysValues:
  """One attention's keys and values [B, S, K, H] ([B, S, 1, D] without
  projections), in the compute dtype."""

  key: Array
  value: Array
  # Whether the arrays stack a scanned stack's groups of blocks along a
  # leading axis, [n, B, S, ...] (model/layer_stack.py's layout).
  stacked: bool = flax.struct.field(pytree_node=False, default=False)


@flax.struct.dataclass
class RecurrentState:
  """A recurrent attention's state after the positions read so far, a
  tree of arrays with rows first (Variant.decoding_state; for the gated
  recurrences a DecodingState of model/attention/variants/gated.py: each query
  head's float32 [H, H] matrix, and the short convolutions' last inputs):
  what decoding carries in place of keys and values, of the same size
  however many positions it has read."""

  state: Any
  # As KeysValues.stacked: each array [n, B, ...] under a scanned stack.
  stacked: bool = flax.struct.field(pytree_node=False, default=False)


@flax.struct.dataclass
class LatentCache:
  """A latent attention's cache (model/attention/variants/latent.py): each
  position's latent [B, S, C] and its keys' rope part [B, S, R], rotated,
  in the compute dtype; C + R numbers a position where KeysValues holds
  2 K H."""

  latent: Array
  rope: Array
  # As KeysValues.stacked.
  stacked: bool = flax.struct.field(pytree_node=False, default=False)


LAYER_CACHES = (KeysValues, RecurrentState, LatentCache)


def _is_layer_cache(node) -> bool:
  return isinstance(node, LAYER_CACHES)


@flax.struct.dataclass
class Cache:
  """A decoder's cache, a KeysValues per layer, a RecurrentState for a
  layer whose attention carries one, or a LatentCache for one that caches
  latents (under scan_layers: per block run
  before the loop, then per block of the group the loop repeats, stacked
  over the groups). `self_attention`: the keys and values of the positions
  written so far, [B, C, ...] for C positions (decoding writes one
  position in place a call), or the state after them; `cross_attention`: the
  source's, projected once (EncoderDecoder.start_decoding) and read by
  every beam of a source, never copied. Each decoding step puts the
  source's half in and takes it out again, so that the cache a decoding
  loop carries (and beam search copies per beam) holds None there, as a
  decoder without cross-attention does."""

  self_attention: tuple[KeysValues | RecurrentState | LatentCache, ...]
  cross_attention: tuple[KeysValues, ...] | None = None
  # The embeddings [B, C, D] written so far, each read by the next
  # position's smear (config.smear); None without smear.
  embeddings: Array | None = None

  @classmethod
  def empty(cls, config: ModelConfig, batch_size: int,
            length: int) -> 'Cache':
    """Zeros for decoding up to `length` positions (no source yet): arrays
    per layer, or per block of a scanned stack's group stacked over the
    groups, which the loop carries whole, so that a step writes one
    position in place either way."""
    shape = (batch_size, length, config.num_kv_heads, config.head_dim)
    if not config.attention_projections:  # The inputs themselves, one head.
      shape = (batch_size, length, 1, config.d_model)

    def zeros(layer, *groups):
      layer_config = config.for_layer(layer)
      variant = attention.spec(layer_config.attention)
      if variant.carries_state:
        return RecurrentState(jax.tree.map(
            lambda a: jnp.zeros(groups + a.shape, a.dtype),
            variant.decoding_state(layer_config, batch_size)),
                              stacked=bool(groups))
      if variant.latent_projections:
        widths = latent.cache_widths(
            layer_config, positions.rotated_channels(layer_config),
            **dict(layer_config.attention_options))
        return LatentCache(*(jnp.zeros(groups + (batch_size, length, width),
                                       config.compute_dtype)
                             for width in widths), stacked=bool(groups))
      return KeysValues(jnp.zeros(groups + shape, config.compute_dtype),
                        jnp.zeros(groups + shape, config.compute_dtype),
                        stacked=bool(groups))
    embeddings = (jnp.zeros((batch_size, length, config.d_model),
                            config.compute_dtype) if config.smear else None)
    if not config.scan_layers:
      return cls(tuple(zeros(layer) for layer in range(config.num_layers)),
                 embeddings=embeddings)
    start, group = config.scan_start, config.scan_group
    count = (config.num_layers - start) // group
    return cls(tuple(zeros(layer) for layer in range(start))
               + tuple(zeros(start + j, count) for j in range(group)),
               embeddings=embeddings)


def map_rows(fn: Callable[[Array, int], Array], cache: Any) -> Any:
  """`fn(array, axis)` applied to each array of a decoding cache (a Cache,
  or a recurrent model's state), `axis` the one its rows are on: the
  second of a scanned stack's stacked arrays, else the first."""
  def apply(node):
    if _is_layer_cache(node):
      axis = 1 if node.stacked else 0
      return jax.tree.map(lambda a: fn(a, axis), node)
    return fn(node, 0)
  return jax.tree.map(apply, cache, is_leaf=_is_layer_cache)


@flax.struct.dataclass
class Memory:
  """A Transformer-XL memory (Dai et al. 2019): the hidden states that
  entered each block over the last M positions, hidden [L, B, M, D], and
  which of them hold a position yet, valid [B, M]."""

  hidden: Array
  valid: Array

  @classmethod
  def empty(cls, config: ModelConfig, batch_size: int) -> 'Memory':
    """A memory holding nothing yet."""
    length = config.memory_length
    return cls(jnp.zeros((config.num_layers, batch_size, length,
                          config.d_model), config.compute_dtype),
               jnp.zeros((batch_size, length), bool))
