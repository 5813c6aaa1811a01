"""Multi-head latent attention (DeepSeek-AI 2024, DeepSeek-V2): each
position's keys and values are made from one shared low-rank latent, so a
decoder caches the latent, not the keys and values.

  c_t = RMSNorm(x_t W_down)                        the latent [C]
  k_t = [r_t ; c_t W_key_up]  v_t = c_t W_value_up   per key/value head
  r_t = x_t W_rope                                 one rope part [R], shared
  q_t = x_t W_query  (or RMSNorm(x_t W_q_down) W_q_up, with q_rank)

A head's first R channels are its decoupled rope part: exactly the
channels rope rotates (config.model.rope_fraction of the head; R = 0 under
a scheme that rotates none; model.positions.rotated_channels), rotated by
the attention layer as it rotates queries and keys. The key's rope part
is one projection shared by the heads, and the other H - R channels come
from the latent, which rope never touches; so a query's product with a
key's latent part is its product, through W_key_up, with the latent
itself, and decoding attends over the cached latents and rope parts
without forming a key or a value (`LatentProjections.attend_cached`):
C + R numbers a position a layer in place of 2 K H. In training, the
keys and values are formed and attended by the exact core as any
layer's.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention import core
from model.attention.core import logical_axes
from model.weight_decay import undecayed

Array = jax.Array


def _xavier(rng, shape, dtype):
  """Xavier over the kernel flattened to (its first dim, the others), as
  the layers' projections are initialised."""
  return nn.initializers.xavier_uniform(
      in_axis=0, out_axis=tuple(range(1, len(shape))))(rng, shape, dtype)


def kv_rank_of(config, kv_rank: int | None) -> int:
  """C, the latent's width: `kv_rank`, or d_model / 4 where None
  (DeepSeek-V2-Lite's 512 of 2048)."""
  return config.d_model // 4 if kv_rank is None else kv_rank


class LatentProjections(nn.Module):
  """An attention layer's queries, keys and values from a shared latent,
  for a layer of `config` (a ModelConfig) whose position scheme rotates
  the first `rope_width` channels of a head (R, the rope part; 0 for
  none): the latent's width `kv_rank` (None: d_model / 4), and the
  queries' own latent's `q_rank` (0: queries projected from the input
  directly, as DeepSeek-V2-Lite does; DeepSeek-V2 uses 1536 of 5120)."""

  config: Any
  rope_width: int
  kv_rank: int | None = None
  q_rank: int = 0

  def setup(self):
    config = self.config
    rank, rope = kv_rank_of(config, self.kv_rank), self.rope_width
    for name, value, least in (('kv_rank', rank, 1),
                               ('q_rank', self.q_rank, 0)):
      if isinstance(value, bool) or not isinstance(value, int) or (
          value < least):
        raise ValueError(f'{name}={value!r} must be a whole number >= '
                         f'{least}.')
    heads, kv_heads = logical_axes.HEADS, logical_axes.KV_HEADS
    latent = logical_axes.LATENT
    h, n, k = config.head_dim, config.num_heads, config.num_kv_heads

    def kernel(name, shape, axes):
      return self.param(name, nn.with_logical_partitioning(_xavier, axes),
                        shape, config.weight_dtype)

    def gain(name, width):
      return self.param(name, undecayed(nn.initializers.ones, (latent,)),
                        (width,), config.weight_dtype)

    self.kv_down = kernel('kv_down', (config.d_model, rank),
                          ('embed', latent))
    self.kv_gain = gain('kv_gain', rank)
    self.key_up = kernel('key_up', (rank, k, h - rope),
                         (latent, kv_heads, 'kv'))
    self.value_up = kernel('value_up', (rank, k, h), (latent, kv_heads, 'kv'))
    self.rope_key = (kernel('rope_key', (config.d_model, rope),
                            ('embed', 'kv')) if rope else None)
    if self.q_rank:
      self.q_down = kernel('q_down', (config.d_model, self.q_rank),
                           ('embed', latent))
      self.q_gain = gain('q_gain', self.q_rank)
      self.q_up = kernel('q_up', (self.q_rank, n, h), (latent, heads, 'kv'))
    else:
      self.query = kernel('query', (config.d_model, n, h),
                          ('embed', heads, 'kv'))

  def _matmul(self, spec: str, x: Array, kernel: Array) -> Array:
    dtype = self.config.compute_dtype
    return jnp.einsum(spec, x.astype(dtype), kernel.astype(dtype))

  def _normed(self, x: Array, gain: Array) -> Array:
    """RMSNorm over the last axis, statistics in float32."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True)
                              + self.config.norm_epsilon)
    return (x32 * gain.astype(jnp.float32)).astype(self.config.compute_dtype)

  def queries(self, x_BxTxD: Array) -> Array:
    """Queries [B, T, N, H], their first R channels the rope part (not yet
    rotated)."""
    if not self.q_rank:
      return self._matmul('btd,dnh->btnh', x_BxTxD, self.query)
    latent = self._normed(self._matmul('btd,dq->btq', x_BxTxD, self.q_down),
                          self.q_gain)
    return self._matmul('btq,qnh->btnh', latent, self.q_up)

  def compress(self, x_BxSxD: Array) -> tuple[Array, Array]:
    """(the latents [B, S, C], the keys' rope parts [B, S, R], not yet
    rotated): what decoding caches."""
    latent = self._normed(self._matmul('bsd,dc->bsc', x_BxSxD, self.kv_down),
                          self.kv_gain)
    if self.rope_key is None:
      return latent, latent[..., :0]
    return latent, self._matmul('bsd,dr->bsr', x_BxSxD, self.rope_key)

  def keys_values(self, latent_BxSxC: Array, rope_BxSxR: Array
                  ) -> tuple[Array, Array]:
    """Keys and values [B, S, K, H] of the latents and the rope parts."""
    kv_heads = self.config.num_kv_heads
    rope = jnp.broadcast_to(rope_BxSxR[:, :, None],
                            (*rope_BxSxR.shape[:2], kv_heads,
                             rope_BxSxR.shape[-1]))
    key = jnp.concatenate(
        [rope, self._matmul('bsc,ckh->bskh', latent_BxSxC, self.key_up)],
        axis=-1)
    return key, self._matmul('bsc,ckh->bskh', latent_BxSxC, self.value_up)

  def attend_cached(self, q_BxTxNxH: Array, latent_BxSxC: Array,
                    rope_BxSxR: Array, mask: Array, *,
                    scale: float | None = None, logit_cap: float = 0.0,
                    sinks: Array | None = None) -> Array:
    """Attention of queries [B, T, N, H] (rotated) over cached latents
    [B, S, C] and rotated rope parts [B, S, R], under mask [B, 1, T, S]
    (True: attend), the logits scaled by `scale` (None: 1 / sqrt(H)) and
    capped at `logit_cap` (0: none), with `sinks` [N] (None: none) in the
    normaliser (core.sink_softmax): what attending over their keys and
    values gives, with neither formed. Each query's other H - R channels
    meet W_key_up before the latents, and the weighted latents meet
    W_value_up after."""
    batch, length, heads, head_dim = q_BxTxNxH.shape
    kv_heads, rope = self.config.num_kv_heads, rope_BxSxR.shape[-1]
    # As the core's: the products over the cache in its dtype, summed in
    # float32, the softmax in float32.
    dtype, f32 = latent_BxSxC.dtype, jnp.float32
    q = q_BxTxNxH.reshape(batch, length, kv_heads, heads // kv_heads,
                          head_dim)
    scale = head_dim ** -0.5 if scale is None else scale
    q_latent = jnp.einsum('btkgh,ckh->btkgc', q[..., rope:].astype(f32),
                          self.key_up.astype(f32))
    logits = (jnp.einsum('btkgc,bsc->bkgts', q_latent.astype(dtype),
                         latent_BxSxC, preferred_element_type=f32)
              + jnp.einsum('btkgr,bsr->bkgts', q[..., :rope].astype(dtype),
                           rope_BxSxR, preferred_element_type=f32))
    logits = core.softcap(logits.reshape(batch, heads, length, -1) * scale,
                          logit_cap)
    weights = core.weights_from_logits(logits, None, mask, False, sinks)
    weighted = jnp.einsum('bkgts,bsc->btkgc', weights.reshape(
        batch, kv_heads, -1, length, weights.shape[-1]).astype(dtype),
                          latent_BxSxC, preferred_element_type=f32)
    out = jnp.einsum('btkgc,ckh->btkgh', weighted, self.value_up.astype(f32))
    return out.reshape(batch, length, heads, head_dim).astype(
        q_BxTxNxH.dtype)


def projections(config, rope_width: int, *, kv_rank: int | None = None,
                q_rank: int = 0) -> LatentProjections:
  """The projections of an `mla` layer of `config` (a ModelConfig) whose
  heads' rope part is `rope_width` channels, its options `kv_rank` and
  `q_rank` (LatentProjections)."""
  return LatentProjections(config, rope_width, kv_rank, q_rank)


def cache_widths(config, rope_width: int, *, kv_rank: int | None = None,
                 **options) -> tuple[int, int]:
  """(C, R): what an `mla` layer of `config` caches a position, its
  latent's width and its rope part's (`rope_width`), given its
  `options`."""
  del options  # The attention's own (its kernel, chunk sizes).
  return kv_rank_of(config, kv_rank), rope_width
