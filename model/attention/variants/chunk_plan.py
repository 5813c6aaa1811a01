"""The plan of blockwise attention (`chunked`): static shapes and options,
which [query block, key chunk] pairs are visited, and the masked logits of
one block, padded where the length is not a multiple of the block.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from model.attention import core

Array = jax.Array


def pad(x: Array | None, axis: int, length: int) -> Array | None:
  """x padded with zeros (False) to `length` along `axis`, unless that axis
  is a broadcast one of size 1."""
  if x is None or x.shape[axis] in (1, length):
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, widths)


def _block(x: Array | None, starts: tuple[Array, Array],
           sizes: tuple[int, int]) -> Array | None:
  """The [query block, key chunk] of x's last two axes (a broadcast axis of
  size 1 is kept)."""
  if x is None:
    return x
  for axis, start, size in zip((-2, -1), starts, sizes):
    if x.shape[axis] != 1:
      x = jax.lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim + axis)
  return x


def add_block(total: Array, update: Array, starts: tuple[Array, Array]
               ) -> Array:
  """total with `update` added at the block `starts` of its last two axes
  (0 along a broadcast axis)."""
  index = [0] * (total.ndim - 2) + [
      start if total.shape[axis] != 1 else 0
      for axis, start in zip((-2, -1), starts)]
  old = jax.lax.dynamic_slice(total, index, update.shape)
  return jax.lax.dynamic_update_slice(total, old + update, index)


# Loops over at most this many blocks, whose logits together take at most
# UNROLLED_LOGITS_BYTES, are unrolled: static slices and no loop overhead,
# while XLA may hold every block's logits at once.
MAX_UNROLLED_BLOCKS = 64
UNROLLED_LOGITS_BYTES = 96 * 2**20


def unrolls(batch: int, num_heads: int, q_len: int, kv_len: int,
             q_chunk: int, kv_chunk: int) -> bool:
  blocks = -(-q_len // q_chunk) * -(-kv_len // kv_chunk)
  return blocks <= MAX_UNROLLED_BLOCKS and (
      blocks * batch * num_heads * q_chunk * kv_chunk * 4
      <= UNROLLED_LOGITS_BYTES)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static shapes and options; which blocks are visited; the logits of one
  block."""

  batch: int
  q_len: int
  num_heads: int
  head_dim: int
  kv_len: int
  num_kv_heads: int
  scale: float
  is_causal: bool
  q_chunk: int
  kv_chunk: int
  # cap * tanh(scores / cap) on q . k * scale, before bias and mask; 0: none.
  logit_cap: float = 0.0

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def num_q_chunks(self) -> int:
    return -(-self.q_len // self.q_chunk)

  @property
  def num_kv_chunks(self) -> int:
    return -(-self.kv_len // self.kv_chunk)

  @property
  def padded_q_len(self) -> int:
    return self.num_q_chunks * self.q_chunk

  @property
  def padded_kv_len(self) -> int:
    return self.num_kv_chunks * self.kv_chunk

  @property
  def unrolled(self) -> bool:
    return unrolls(self.batch, self.num_heads, self.q_len, self.kv_len,
                    self.q_chunk, self.kv_chunk)

  def key_chunks_seen(self) -> np.ndarray:
    """[query blocks]: how many chunks of keys, from the first, the queries
    of each block see (causal: up to the last query's diagonal, aligned
    bottom-right as `core.causal_mask`)."""
    if not self.is_causal:
      return np.full(self.num_q_chunks, self.num_kv_chunks, np.int32)
    last_query = np.minimum(
        (np.arange(self.num_q_chunks) + 1) * self.q_chunk, self.q_len) - 1
    last_key = last_query + self.kv_len - self.q_len
    return np.clip(last_key // self.kv_chunk + 1, 0,
                   self.num_kv_chunks).astype(np.int32)

  def first_query_block(self) -> np.ndarray:
    """[key chunks]: the first block of queries that sees each chunk (the
    number of blocks if none does)."""
    return np.searchsorted(self.key_chunks_seen(),
                           np.arange(self.num_kv_chunks),
                           side='right').astype(np.int32)

  def queries(self, query: Array) -> Array:
    """[B, T, N, H] -> float32 [B, K, G, padded T, H]."""
    q = query.reshape(self.batch, self.q_len, self.num_kv_heads, self.group,
                      self.head_dim)
    q = jnp.transpose(q, (0, 2, 3, 1, 4)).astype(jnp.float32)
    return pad(q, 3, self.padded_q_len)

  def query_block(self, x: Array, index: Array) -> Array:
    """Block `index` of x's query axis (axis 3 of [B, K, G, T, ...])."""
    return jax.lax.dynamic_slice_in_dim(x, index * self.q_chunk, self.q_chunk,
                                        axis=3)

  def key_chunk(self, x: Array, index: Array) -> Array:
    """Chunk `index` of keys or values [B, S, K, H]."""
    return jax.lax.dynamic_slice_in_dim(x, index * self.kv_chunk,
                                        self.kv_chunk, axis=1)

  def starts(self, q_index: Array, kv_index: Array) -> tuple[Array, Array]:
    return q_index * self.q_chunk, kv_index * self.kv_chunk

  def bias_block(self, bias: Array, q_index: Array, kv_index: Array):
    """The bias array's block (q_index, kv_index), [B?, K?, G?, Tq?,
    Tk?]."""
    return _block(bias, self.starts(q_index, kv_index),
                  (self.q_chunk, self.kv_chunk))

  def scored(self, scores_BxKxGxQxC: Array, bias, q_index: Array,
             kv_index: Array) -> Array:
    """The block's scores under the bias: plus a bias array's block, or
    through a PositionBias's score function."""
    if bias is None:
      return scores_BxKxGxQxC
    if not isinstance(bias, core.PositionBias):
      return scores_BxKxGxQxC + self.bias_block(bias, q_index, kv_index
                                                ).astype(jnp.float32)
    # Padded queries and keys read the last real one (and are masked).
    queries = jnp.minimum(q_index * self.q_chunk + jnp.arange(self.q_chunk),
                          self.q_len - 1)
    keys = jnp.minimum(kv_index * self.kv_chunk + jnp.arange(self.kv_chunk),
                       self.kv_len - 1)
    logits = bias.apply(scores_BxKxGxQxC.reshape(
        self.batch, self.num_heads, self.q_chunk, self.kv_chunk),
                        queries[:, None], keys[None, :])
    return logits.reshape(scores_BxKxGxQxC.shape)

  def mask_block(self, mask, q_index: Array, kv_index: Array):
    """The mask of block (q_index, kv_index), [B?, K?, G?, Tq?, Tk?]."""
    if isinstance(mask, core.PatternMask):
      queries = q_index * self.q_chunk + jnp.arange(self.q_chunk)
      keys = kv_index * self.kv_chunk + jnp.arange(self.kv_chunk)
      allowed = jnp.asarray(mask.pattern.allowed(queries[:, None],
                                                 keys[None, :]))
      inner = self.mask_block(mask.mask, q_index, kv_index)
      return allowed if inner is None else inner & allowed
    if not isinstance(mask, core.SegmentMask):
      return None if mask is None else _block(
          mask, self.starts(q_index, kv_index), (self.q_chunk, self.kv_chunk))
    # Slices of the (padded) ids, compared: [B, 1, 1, Q, C].
    q_start, kv_start = self.starts(q_index, kv_index)
    q_ids = jax.lax.dynamic_slice_in_dim(mask.q_segment_ids_BxT, q_start,
                                         self.q_chunk, axis=1)
    kv_ids = jax.lax.dynamic_slice_in_dim(mask.kv_ids, kv_start,
                                          self.kv_chunk, axis=1)
    return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None, None]

  def scores(self, q_BxKxGxQxH, k_BxCxKxH):
    """q . k * scale of a block, capped by `logit_cap`: [B, K, G, Q, C]."""
    scores = jnp.einsum('bkgqh,bckh->bkgqc', q_BxKxGxQxH,
                        k_BxCxKxH.astype(jnp.float32)) * self.scale
    return core.softcap(scores, self.logit_cap)

  def logits(self, q_BxKxGxQxH, k_BxCxKxH, bias, mask, q_index, kv_index):
    """Masked logits of block (q_index, kv_index), [B, K, G, Q, C], -inf
    where excluded."""
    return self.masked(self.scores(q_BxKxGxQxH, k_BxCxKxH), bias, mask,
                       q_index, kv_index)

  def masked(self, scores, bias, mask, q_index, kv_index):
    """The block's `scores` under the bias (`scored`), -inf where
    excluded."""
    logits = self.scored(scores, bias, q_index, kv_index)
    queries = q_index * self.q_chunk + jnp.arange(self.q_chunk)
    keys = kv_index * self.kv_chunk + jnp.arange(self.kv_chunk)
    # The padding of the last block and chunk.
    valid = (queries[:, None] < self.q_len) & (keys[None, :] < self.kv_len)
    if self.is_causal:
      valid = valid & (keys[None, :]
                       <= queries[:, None] + self.kv_len - self.q_len)
    mask = self.mask_block(mask, q_index, kv_index)
    if mask is not None:
      valid = valid & mask
    return jnp.where(valid, logits, -jnp.inf)

  def join_queries(self, x: Array) -> Array:
    """[query blocks, B, K, G, Q, ...] -> [B, K, G, padded T, ...]."""
    x = jnp.moveaxis(x, 0, 3)
    return x.reshape(*x.shape[:3], -1, *x.shape[5:])
