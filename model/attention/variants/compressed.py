"""`memory_compressed`: attention to keys and values shortened by a strided
convolution.

The memory-compressed attention of Liu et al. (2018), the Transformer-DMCA
of "Generating Wikipedia by Summarizing Long Sequences". Keys and values
[B, S, K, H] are each convolved along the length, all heads' channels
mixed, with a kernel `width` positions wide moved `stride` at a time (3
and 3 in the paper): S' = ceil(S / stride) compressed keys and values, and
scores [B, N, T, S'], about 1/stride of dense attention's. Compressed key j
reads positions j * stride + stride - width .. j * stride + stride - 1
(zeros before 0 and after S - 1), so with width == stride the windows are
the consecutive blocks of `stride` positions.

Causal: query i reads compressed key j only when the window's last
position is <= i, so no query sees a later key. The first stride - 1
queries read none and output zeros; the paper alternates these layers with
local attention (a pattern such as 'local,memory_compressed' in
config.model.attention), which covers them.

A key padding mask [B?, 1, 1, S] drops the padded keys from every window
(they are zeroed before the convolution) and a window with no real key.
"""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model.attention import core

Array = jax.Array


def compress(x_BxSxKxH: Array, kernel_WxKxHxKxH: Array, stride: int
             ) -> Array:
  """[B, S, K, H] -> [B, ceil(S / stride), K, H]: the strided convolution
  (window W = kernel_WxKxHxKxH.shape[0]) over the zero-padded length."""
  batch, length, num_kv_heads, head_dim = x_BxSxKxH.shape
  window = kernel_WxKxHxKxH.shape[0]
  compressed = -(-length // stride)
  channels = num_kv_heads * head_dim
  x_BxSxC = x_BxSxKxH.reshape(batch, length, channels)
  # Window j ends at position j * stride + stride - 1.
  padding = (window - stride, compressed * stride - length)
  out_BxSxC = jax.lax.conv_general_dilated(
      x_BxSxC, kernel_WxKxHxKxH.reshape(window, channels, channels).astype(
          x_BxSxC.dtype),
      window_strides=(stride,), padding=(padding,),
      dimension_numbers=('NWC', 'WIO', 'NWC'))
  return out_BxSxC.reshape(batch, compressed, num_kv_heads, head_dim)


def _window_ends(length: int, stride: int) -> np.ndarray:
  """[S'] the last position each compressed key reads."""
  return np.arange(-(-length // stride)) * stride + stride - 1


def memory_compressed_attention(
    query: Array, key: Array, value: Array, bias: Array | None = None,
    mask: Array | None = None, *, scale: float | None = None,
    is_causal: bool = False, key_kernel: Array, value_kernel: Array,
    stride: int = 3, sinks: Array | None = None) -> Array:
  """softmax(q compress(k)^T * scale) compress(v), [B, T, N, H].

  Args:
    key_kernel: the keys' convolution [W, K, H, K, H] (W positions, from
      key/value head and channel to key/value head and channel).
    value_kernel: the values', the same shape.
    stride: positions between consecutive windows, at most W.
    sinks: as dense's.
  """
  core.check_inputs(query, key, value, bias, mask)
  if bias is not None:
    raise ValueError('memory_compressed attention takes no bias: its keys '
                     'are not positions.')
  core.check_self_key_padding('memory_compressed', query, key, mask)
  window = key_kernel.shape[0]
  if not 1 <= stride <= window:
    raise ValueError(f'stride={stride} must be in [1, width={window}]: '
                     'windows further apart would skip positions.')
  expected = (window,) + key.shape[2:] + key.shape[2:]
  for name, kernel in (('key_kernel', key_kernel),
                       ('value_kernel', value_kernel)):
    if kernel.shape != expected:
      raise ValueError(f'{name} has shape {kernel.shape}; expected [W, K, H, '
                       f'K, H] = {expected}.')
  length = key.shape[1]
  compressed_mask = None
  if mask is not None:
    keep_BxSx1x1 = mask[:, 0, 0, :, None, None]
    key = jnp.where(keep_BxSx1x1, key, 0)
    value = jnp.where(keep_BxSx1x1, value, 0)
    # A window holding any real key: [B?, 1, 1, S'].
    counts = compress(keep_BxSx1x1.astype(jnp.float32),
                      jnp.ones((window, 1, 1, 1, 1)), stride)
    compressed_mask = (counts[:, :, 0, 0] > 0)[:, None, None, :]
  if is_causal:
    ends = _window_ends(length, stride)
    causal = jnp.asarray(ends[None, :] <= np.arange(length)[:, None])[
        None, None]
    compressed_mask = (causal if compressed_mask is None
                       else compressed_mask & causal)
  if scale is None:
    scale = 1.0 / math.sqrt(query.shape[-1])
  return core.scaled_dot_product_attention(
      query, compress(key, key_kernel, stride),
      compress(value, value_kernel, stride), mask=compressed_mask,
      scale=scale, sinks=sinks)


def parameters(module: nn.Module, config, *, width: int = 3,
               **options) -> dict[str, Any]:
  """The keys' and values' convolutions [width, K, H, K, H], Xavier over
  (width * K * H inputs, K * H outputs), created in `module` for a layer of
  `config` (a ModelConfig); with the other `options`, the keyword
  arguments of memory_compressed_attention."""
  if width < 1:
    raise ValueError(f'width={width} must be positive.')
  shape = (width, config.num_kv_heads, config.head_dim,
           config.num_kv_heads, config.head_dim)

  def init(rng, shape, dtype):
    flat = (math.prod(shape[:3]), math.prod(shape[3:]))
    return nn.initializers.xavier_uniform()(rng, flat, dtype).reshape(shape)

  init = nn.with_logical_partitioning(
      init, (None, None, None, 'kv_heads', 'kv'))
  return options | {
      'key_kernel': module.param('compress_key', init, shape,
                                 config.weight_dtype),
      'value_kernel': module.param('compress_value', init, shape,
                                   config.weight_dtype)}
