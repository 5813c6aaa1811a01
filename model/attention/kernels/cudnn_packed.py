"""Packed rows on cuDNN's fused attention: segment ids as its packed layout.

cuDNN (Hopper and newer) attends within segments given by each row's
segment lengths and offsets: `seqlen` [B, M] and `offsets` [B, M + 1], the
rows' segments left-aligned and the unused entries -1, M the most segments
a row may hold. jax reaches it through a private function,
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`; this
module is the one place that calls it, for the jax versions in KNOWN_JAX.

A segment here is a run of equal ids, the trailing padding included, so
that every token is in one and the layout is the SegmentMask exactly where
each id makes one run: as the packer lays out rows. A row of more runs than
M, or whose ids come back after another id, is not what the layout can
say; it comes out NaN, loudly, instead of silently different from dense.
"""

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
# The jax versions whose private function this module is written against:
# the packed layout arrived in 0.5.1; the signature and the offsets' meaning
# are those read in 0.10.2 and 0.11.0, and 0.11.2 is what the accelerator
# report's GPU machine runs. Through 0.11.0 jax scales the keys' offsets by
# the queries' heads (jax PR 39521 fixed it later), so grouped-query keys
# and values always go in repeated to the query heads.
KNOWN_JAX = ((0, 5, 1), (0, 11, 2))


def _jax_version() -> tuple[int, ...]:
  return tuple(int(part) for part in jax.__version_info__[:3])


# The oldest cuDNN jax tests the packed layout on.
MIN_CUDNN = 90600


def _cudnn_version() -> int | None:
  """The loaded cuDNN's version (e.g. 91000), None where there is none."""
  from jax._src.lib import cuda_versions  # Private, as the call is.
  return None if cuda_versions is None else cuda_versions.cudnn_get_version()


def refusal() -> str | None:
  """Why this jax and cuDNN cannot run the packed layout; None if they can
  (or, with no cuDNN loaded, if this jax can)."""
  low, high = KNOWN_JAX
  if not low <= _jax_version() <= high:
    return (f'takes packed rows with jax {".".join(map(str, low))} to '
            f'{".".join(map(str, high))} (a private jax API), not '
            f'{jax.__version__}')
  cudnn = _cudnn_version()
  if cudnn is not None and cudnn < MIN_CUDNN:
    return f'takes packed rows with cuDNN 9.6 or newer, not {cudnn}'
  return None


def segment_layout(ids_BxT: Array, max_segments: int
                   ) -> tuple[Array, Array, Array]:
  """(seqlen [B, M], offsets [B, M + 1], fits [B]) of segment ids, M =
  `max_segments`: each run of equal ids a segment, its length and first
  position, -1 past the row's last; `fits` is False for a row of more than
  M runs or an id in two runs."""
  batch, length = ids_BxT.shape
  starts = jnp.concatenate(
      [jnp.ones((batch, 1), bool), ids_BxT[:, 1:] != ids_BxT[:, :-1]], 1)
  run_BxT = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1
  runs = run_BxT[:, -1] + 1
  ordered = jnp.sort(ids_BxT, axis=1)
  distinct = 1 + jnp.sum(ordered[:, 1:] != ordered[:, :-1], axis=1)
  fits = (runs == distinct) & (runs <= max_segments)
  rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, length))
  counts = jnp.zeros((batch, max_segments), jnp.int32).at[
      rows, run_BxT].add(1, mode='drop')
  used = jnp.arange(max_segments)[None] < runs[:, None]
  firsts = jnp.cumsum(counts, axis=1) - counts
  seqlen = jnp.where(used, counts, -1)
  offsets = jnp.pad(jnp.where(used, firsts, -1), ((0, 0), (0, 1)),
                    constant_values=-1)
  return seqlen, offsets, fits


def _cudnn(query, key, value, seqlen, offsets, *, scale, is_causal):
  # Imported here: the private module is only read where the call runs.
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_ops
  mask_type = (cudnn_ops.MaskType.PADDING_CAUSAL if is_causal
               else cudnn_ops.MaskType.PADDING)
  return cudnn_ops.dot_product_attention(
      query, key, value, q_seqlen=seqlen, kv_seqlen=seqlen,
      q_offsets=offsets, kv_offsets=offsets, scale=scale,
      mask_type=mask_type, qkv_layout='BTNH')


def attention(query: Array, key: Array, value: Array, ids_BxT: Array, *,
              scale: float, is_causal: bool, max_segments: int,
              call=_cudnn) -> Array:
  """Self-attention [B, T, N, H] within the segments of `ids_BxT`, by
  `call(query, key, value, seqlen, offsets, scale=, is_causal=)`: cuDNN's
  packed layout (tests pass a reference of the same contract)."""
  seqlen, offsets, fits = segment_layout(ids_BxT, max_segments)
  group = query.shape[2] // key.shape[2]
  key, value = (jnp.repeat(x, group, axis=2) for x in (key, value))
  out = call(query, key, value, seqlen, offsets, scale=scale,
             is_causal=is_causal)
  return jnp.where(fits[:, None, None, None], out, np.nan).astype(out.dtype)
