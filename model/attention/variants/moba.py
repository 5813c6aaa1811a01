"""Mixture of block attention (`moba`; Lu et al. 2025, MoBA): a sparsity
chosen by the data. The positions are cut into blocks of `block_size`;
each query attends to its own block (causally, where causal) and to the
`top_k` other blocks (earlier ones, where causal) whose mean key its
score q . mean(k) ranks best, exactly, softmax over all the keys chosen:
O(T * (top_k + 1) * block_size) work, and as much memory for the keys
each query gathers. Each query chooses for itself, as MoBA's gate does: a
choice shared by a block's queries would let a query's output depend on
the later queries of its block. The choice is a top-k, with no gradient;
the gradients are those of exact attention under the mask it makes.

The choice is made in XLA; the attention over the chosen blocks runs in
XLA too (gathering each query's blocks), or in the general fused kernel
(kernels/flex.py, `kernel=`), which visits the tiles of the chosen blocks
from tables computed on the device from the choice.
"""

import math

import jax
import jax.numpy as jnp

from model.attention import core
from model.attention.core import patterns
from model.attention.kernels import fused

Array = jax.Array


def _check(query: Array, key: Array, value: Array, bias, mask,
           block_size: int, top_k: int) -> None:
  core.check_inputs(query, key, value, bias, mask)
  if bias is not None:
    raise ValueError('moba attention takes no bias: its blocks are chosen '
                     'by scores that never see one.')
  core.check_self_key_padding('moba', query, key, mask)
  for name, value_ in (('block_size', block_size), ('top_k', top_k)):
    if isinstance(value_, bool) or not isinstance(value_, int) or value_ < 1:
      raise ValueError(f'{name}={value_!r} must be a whole number >= 1.')


def chosen_blocks(query: Array, key: Array, keep: Array, *, block_size: int,
                  top_k: int, is_causal: bool) -> tuple[Array, Array]:
  """(blocks [B, N, T, k], chosen [B, N, T, k] bool), k = min(top_k, the
  number of blocks): for each query and head, the other key blocks of the
  best scores q . mean(k), best first, and whether each slot holds one (a
  query has fewer than k eligible blocks: earlier ones, where causal,
  holding a key that `keep` [B, T] keeps). query [B, T, N, H] and key
  [B, T, K, H], T a whole number of blocks."""
  batch, length, heads, head_dim = query.shape
  kv_heads, count = key.shape[2], length // block_size
  weights = keep.astype(jnp.float32).reshape(batch, count, block_size)
  kept = jnp.sum(weights, axis=2)  # [B, Q] keys in each block.
  mean_key = jnp.einsum('bcj,bcjkh->bckh', weights, key.astype(
      jnp.float32).reshape(batch, count, block_size, kv_heads, head_dim)
                        ) / jnp.maximum(kept, 1.0)[..., None, None]
  scores = jnp.einsum('btkgh,bckh->bkgtc', query.astype(jnp.float32).reshape(
      batch, length, kv_heads, heads // kv_heads, head_dim), mean_key)
  scores = scores.reshape(batch, heads, length, count)
  own = (jnp.arange(length) // block_size)[:, None]
  columns = jnp.arange(count)[None, :]
  eligible = (columns < own) if is_causal else (columns != own)
  eligible = eligible & (kept > 0)[:, None, None, :]
  best, blocks = jax.lax.top_k(jnp.where(eligible, scores, -jnp.inf),
                               min(top_k, count))
  return blocks, jnp.isfinite(best)


def moba_attention(query: Array, key: Array, value: Array,
                   bias: Array | None = None, mask: Array | None = None, *,
                   scale: float | None = None, is_causal: bool = False,
                   block_size: int = 64, top_k: int = 3,
                   sinks: Array | None = None,
                   kernel: str = 'auto') -> Array:
  """MoBA: each query attends to its own block of `block_size` positions
  and to the `top_k` other blocks its score against their mean keys ranks
  best (module docstring), [B, T, N, H].

  Args:
    query: [B, T, N, H]; key, value: [B, T, K, H], K dividing N.
    mask: a key padding mask [B, 1, 1, T] or None; padded keys count in no
      block's mean and are never attended.
    block_size: positions a block (MoBA's 512 at 8K tokens).
    top_k: blocks chosen besides a query's own (MoBA's 3 counts its own).
    sinks: as dense's.
    kernel: one of fused.KERNELS, for the attention over the chosen
      blocks: 'xla' for the JAX code here, a fused kernel for the general
      kernel (pallas_gpu, pallas_tpu), 'auto' as fused.choose.
  """
  _check(query, key, value, bias, mask, block_size, top_k)
  core.check_sinks(sinks, query.shape[2])
  pattern = patterns.Moba(block_size)
  kernel = fused.choose(kernel, fused.case_of(
      query, key, None, mask, is_causal=is_causal, pattern=pattern,
      sinks=sinks))
  inputs = query, key, value
  batch, length, heads, head_dim = query.shape
  kv_heads = key.shape[2]
  scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
  count = -(-length // block_size)
  padded = count * block_size
  keep = jnp.broadcast_to(jnp.arange(padded) < length, (batch, padded))
  if mask is not None:
    keep = keep & jnp.pad(jnp.broadcast_to(mask[:, 0, 0], (batch, length)),
                          ((0, 0), (0, padded - length)))
  query, key, value = (jnp.pad(x, ((0, 0), (0, padded - length), (0, 0),
                                   (0, 0))) for x in (query, key, value))
  blocks, chosen = chosen_blocks(query, key, keep, block_size=block_size,
                                 top_k=top_k, is_causal=is_causal)
  if kernel != 'xla':
    return fused.run(kernel, *inputs, None, mask, scale=scale,
                     is_causal=is_causal, pattern=pattern, sinks=sinks,
                     routing=jnp.where(chosen, blocks, -1)[:, :, :length])
  heads_kv = jnp.arange(heads) // (heads // kv_heads)

  def by_block(x):  # [B, T, K, ...] -> [B, N, Q, block_size, ...]
    x = x.reshape(batch, count, block_size, *x.shape[2:])
    return jnp.moveaxis(x, 3, 1)[:, heads_kv]

  kept = jnp.broadcast_to(keep[:, :, None], (batch, padded, kv_heads))
  keys, values, kept = by_block(key), by_block(value), by_block(kept)
  queries = jnp.moveaxis(query, 2, 1)  # [B, N, T, H]
  # Its own block's keys: [B, N, T, block_size].
  own = jnp.einsum('bnqih,bnqch->bnqic', queries.reshape(
      batch, heads, count, block_size, head_dim), keys,
                   preferred_element_type=jnp.float32).reshape(
                       batch, heads, padded, block_size)
  offsets = jnp.arange(block_size)
  own_allowed = jnp.repeat(kept, block_size, axis=2)  # [B, N, T, c]
  if is_causal:
    own_allowed = own_allowed & jnp.tile(
        offsets[None, :] <= offsets[:, None], (count, 1))
  # The chosen blocks' keys, gathered for each query: [B, N, T, k, c, H].
  rows = (jnp.arange(batch)[:, None, None, None],
          jnp.arange(heads)[None, :, None, None], blocks)
  picked = jnp.einsum('bnth,bntjch->bntjc', queries, keys[rows],
                      preferred_element_type=jnp.float32)
  picked_allowed = chosen[..., None] & kept[rows]
  logits = jnp.concatenate([
      jnp.where(own_allowed, own, -jnp.inf),
      jnp.where(picked_allowed, picked, -jnp.inf).reshape(
          batch, heads, padded, -1)], axis=-1) * scale
  weights = core.sink_softmax(logits, sinks).astype(value.dtype)
  out = (jnp.einsum('bnqic,bnqch->bnqih', weights[..., :block_size].reshape(
      batch, heads, count, block_size, block_size), values,
                    preferred_element_type=jnp.float32).reshape(
                        batch, heads, padded, head_dim)
         + jnp.einsum('bntjc,bntjch->bnth', weights[..., block_size:].reshape(
             *picked.shape), values[rows],
                      preferred_element_type=jnp.float32))
  return jnp.moveaxis(out, 1, 2)[:, :length].astype(query.dtype)
