"""`chunked`: exact attention a chunk of keys at a time, with an online softmax.

The memory-efficient attention of Rabe & Staats (2021), which is also the
algorithm of FlashAttention (Dao et al. 2022). Keys and values are visited a
chunk at a time; each query keeps a running maximum logit, a running sum of
exponentials and a running weighted sum of values. Logits exist for one
chunk at a time, so memory is O(T * chunk) rather than O(T * S). A custom VJP
saves only the output and each query's log-sum-exp, and recomputes every
chunk's weights in the backward pass, so the backward pass is O(T * chunk)
too. Any S works: the last chunk is padded with masked keys.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from model.attention import core

Array = jax.Array


def split_heads(x: Array | None, num_kv_heads: int) -> Array | None:
  """[B, N, T, S]-broadcastable -> [B, K, G, T, S]-broadcastable."""
  if x is None:
    return None
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], num_kv_heads, -1, *x.shape[2:])


def _slice_keys(x: Array | None, index: Array, chunk: int) -> Array | None:
  """Keys [index * chunk, (index + 1) * chunk) of x's last axis, if it has
  more than one (a broadcast axis of 1 is kept)."""
  if x is None or x.shape[-1] == 1:
    return x
  return jax.lax.dynamic_slice_in_dim(x, index * chunk, chunk, axis=-1)


def _position_bias_chunk(plan: '_Plan', bias: core.PositionBias,
                         index: Array) -> Array:
  """A PositionBias at all queries and the keys of chunk `index`,
  [B?, K?, G?, T, C]; keys past the end read the last one (and are masked)."""
  keys = jnp.minimum(index * plan.chunk + jnp.arange(plan.chunk),
                     plan.kv_len - 1)
  values = bias.at(jnp.arange(plan.q_len)[:, None], keys[None, :])
  return split_heads(values, plan.num_kv_heads)


def _bias_chunk(plan: '_Plan', bias, index: Array):
  if isinstance(bias, core.PositionBias):
    return _position_bias_chunk(plan, bias, index)
  return _slice_keys(bias, index, plan.chunk)


def _pad_keys(x: Array | None, padded_len: int, axis: int) -> Array | None:
  if x is None or x.shape[axis] in (1, padded_len):
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, padded_len - x.shape[axis])
  return jnp.pad(x, widths)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static shapes and options; the logits of one chunk of keys."""

  batch: int
  q_len: int
  num_heads: int
  head_dim: int
  kv_len: int
  num_kv_heads: int
  scale: float
  is_causal: bool
  chunk: int

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def num_chunks(self) -> int:
    return -(-self.kv_len // self.chunk)

  @property
  def padded_len(self) -> int:
    return self.num_chunks * self.chunk

  def queries(self, query: Array) -> Array:
    """[B, T, N, H] -> float32 [B, K, G, T, H]."""
    q = query.reshape(self.batch, self.q_len, self.num_kv_heads, self.group,
                      self.head_dim)
    return jnp.transpose(q, (0, 2, 3, 1, 4)).astype(jnp.float32)

  def logits(self, q_BxKxGxTxH, k_BxCxKxH, bias_c, mask_c, index):
    """Masked logits of chunk `index`, [B, K, G, T, C], -inf where excluded."""
    logits = jnp.einsum('bkgth,bckh->bkgtc', q_BxKxGxTxH,
                        k_BxCxKxH.astype(jnp.float32)) * self.scale
    if bias_c is not None:
      logits = logits + bias_c.astype(jnp.float32)
    key_positions = index * self.chunk + jnp.arange(self.chunk)
    valid = key_positions < self.kv_len  # The padding of the last chunk.
    if self.is_causal:
      offset = self.kv_len - self.q_len
      valid = valid & (key_positions[None, :]
                       <= jnp.arange(self.q_len)[:, None] + offset)
    if mask_c is not None:
      valid = valid & mask_c
    return jnp.where(valid, logits, -jnp.inf)


def online_softmax_init(shape: tuple[int, ...], head_dim: int):
  """The online softmax of rows `shape` before any key: (running max, running
  sum of exponentials, running weighted sum of values [*shape, head_dim])."""
  return (jnp.full(shape, -jnp.inf), jnp.zeros(shape),
          jnp.zeros(shape + (head_dim,)))


def online_softmax_step(stats, logits_BxKxGxTxC: Array, v_BxCxKxH: Array):
  """`stats` after one more chunk of keys: its masked logits (-inf where
  excluded) and its values."""
  row_max, row_sum, acc = stats
  new_max = jnp.maximum(row_max, jnp.max(logits_BxKxGxTxC, axis=-1))
  # Rows with nothing to attend yet keep a reference of 0, not -inf.
  reference = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
  rescale = jnp.exp(row_max - reference)
  weights = jnp.exp(logits_BxKxGxTxC - reference[..., None])
  row_sum = row_sum * rescale + jnp.sum(weights, axis=-1)
  acc = acc * rescale[..., None] + jnp.einsum(
      'bkgtc,bckh->bkgth', weights, v_BxCxKxH.astype(jnp.float32))
  return new_max, row_sum, acc


def online_softmax_result(stats) -> tuple[Array, Array]:
  """(output [B, K, G, T, H], log-sum-exp [B, K, G, T]) of the keys seen;
  rows that saw none give 0 and a log-sum-exp of +inf."""
  row_max, row_sum, acc = stats
  nonempty = row_sum > 0
  out = acc / jnp.where(nonempty, row_sum, 1.0)[..., None]
  reference = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  log_sum_exp = jnp.where(nonempty, reference + jnp.log(
      jnp.where(nonempty, row_sum, 1.0)), jnp.inf)
  return out, log_sum_exp


def _forward(plan: _Plan, query, key, value, bias, mask):
  """Output [B, K, G, T, H] and log-sum-exp [B, K, G, T] (+inf for empty
  rows)."""
  q = plan.queries(query)

  def step(stats, index):
    k_c = jax.lax.dynamic_slice_in_dim(key, index * plan.chunk, plan.chunk, 1)
    v_c = jax.lax.dynamic_slice_in_dim(value, index * plan.chunk, plan.chunk,
                                       1)
    logits = plan.logits(q, k_c, _bias_chunk(plan, bias, index),
                         _slice_keys(mask, index, plan.chunk), index)
    return online_softmax_step(stats, logits, v_c), None

  init = online_softmax_init(
      (plan.batch, plan.num_kv_heads, plan.group, plan.q_len), plan.head_dim)
  stats, _ = jax.lax.scan(step, init, jnp.arange(plan.num_chunks))
  return online_softmax_result(stats)


def _to_output(plan: _Plan, out_BxKxGxTxH: Array, dtype) -> Array:
  out = jnp.transpose(out_BxKxGxTxH, (0, 3, 1, 2, 4))
  return out.reshape(plan.batch, plan.q_len, plan.num_heads,
                     plan.head_dim).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan, query, key, value, bias, mask):
  out, _ = _forward(plan, query, key, value, bias, mask)
  return _to_output(plan, out, query.dtype)


def _attend_fwd(plan, query, key, value, bias, mask):
  out, log_sum_exp = _forward(plan, query, key, value, bias, mask)
  residuals = (query, key, value, bias, mask, out, log_sum_exp)
  return _to_output(plan, out, query.dtype), residuals


def _reduce_to(x: Array, shape: tuple[int, ...]) -> Array:
  """Sums x over the axes where `shape` (same rank) has 1."""
  axes = tuple(i for i, (d, s) in enumerate(zip(x.shape, shape))
               if s == 1 and d != 1)
  return jnp.sum(x, axis=axes, keepdims=True)


def _add_inexact(total, update):
  """total + update on float leaves; integer leaves (whose cotangents are
  float0) keep total's placeholder."""
  return jax.tree.map(
      lambda t, u: t + u if jnp.issubdtype(t.dtype, jnp.inexact) else t,
      total, update)


def _zero_integers(data, d_data):
  """d_data with float0 zeros at data's integer leaves, as JAX wants for
  the cotangent of an integer input."""
  return jax.tree.map(
      lambda x, d: d if jnp.issubdtype(x.dtype, jnp.inexact)
      else np.zeros(x.shape, jax.dtypes.float0), data, d_data)


def _attend_bwd(plan, residuals, d_out):
  query, key, value, bias, mask, out, log_sum_exp = residuals
  q = plan.queries(query)
  d_out_5 = plan.queries(d_out)
  # D_i = sum_h dO_ih O_ih: the softmax backward's per-row correction.
  correction = jnp.sum(d_out_5 * out, axis=-1)

  position_bias = isinstance(bias, core.PositionBias)

  def step(carry, index):
    d_query, d_bias_data = carry
    k_c = jax.lax.dynamic_slice_in_dim(key, index * plan.chunk, plan.chunk, 1)
    v_c = jax.lax.dynamic_slice_in_dim(value, index * plan.chunk, plan.chunk,
                                       1)
    if position_bias:
      bias_c, pull_back = jax.vjp(
          lambda data: _position_bias_chunk(
              plan, core.PositionBias(data, bias.fn), index), bias.data)
    else:
      bias_c = _slice_keys(bias, index, plan.chunk)
    logits = plan.logits(q, k_c, bias_c, _slice_keys(mask, index, plan.chunk),
                         index)
    weights = jnp.exp(logits - log_sum_exp[..., None])
    d_value = jnp.einsum('bkgtc,bkgth->bckh', weights, d_out_5)
    d_weights = jnp.einsum('bkgth,bckh->bkgtc', d_out_5,
                           v_c.astype(jnp.float32))
    d_logits = weights * (d_weights - correction[..., None])
    d_query = d_query + plan.scale * jnp.einsum(
        'bkgtc,bckh->bkgth', d_logits, k_c.astype(jnp.float32))
    d_key = plan.scale * jnp.einsum('bkgtc,bkgth->bckh', d_logits, q)
    d_bias = None
    if position_bias:
      d_bias_data = _add_inexact(
          d_bias_data, pull_back(_reduce_to(d_logits, bias_c.shape))[0])
    elif bias is not None:
      d_bias = _reduce_to(d_logits, bias_c.shape)
    return (d_query, d_bias_data), (d_key, d_value, d_bias)

  d_bias_data = None
  if position_bias:
    d_bias_data = jax.tree.map(jnp.zeros_like, bias.data)
  (d_query, d_bias_data), (d_key, d_value, d_bias) = jax.lax.scan(
      step, (jnp.zeros_like(q), d_bias_data), jnp.arange(plan.num_chunks))

  def join_chunks(x):  # [chunks, B, C, K, H] -> [B, chunks * C, K, H]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])

  d_key = join_chunks(d_key).astype(key.dtype)
  d_value = join_chunks(d_value).astype(value.dtype)
  if position_bias:
    d_bias = core.PositionBias(_zero_integers(bias.data, d_bias_data),
                               bias.fn)
  elif d_bias is not None:
    # [chunks, B?, K?, G?, T?, C?] -> the bias's [B?, K?, G?, T?, S?].
    d_bias = jnp.moveaxis(d_bias, 0, -2)
    d_bias = d_bias.reshape(*d_bias.shape[:-2], -1)
    if bias.shape[-1] == 1:
      d_bias = jnp.sum(d_bias, axis=-1, keepdims=True)
    d_bias = d_bias.astype(bias.dtype)
  return (_to_output(plan, d_query, query.dtype), d_key, d_value, d_bias,
          None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def chunked_attention(query: Array, key: Array, value: Array,
                      bias: Array | None = None, mask: Array | None = None, *,
                      scale: float | None = None, is_causal: bool = False,
                      chunk_size: int = 512) -> Array:
  """`scaled_dot_product_attention`, exactly, in O(T * chunk_size) memory.

  Args:
    chunk_size: keys per chunk; the last chunk is padded.
  """
  core.check_inputs(query, key, value, bias, mask)
  if chunk_size < 1:
    raise ValueError(f'chunk_size={chunk_size} must be positive.')
  batch, q_len, num_heads, head_dim = query.shape
  plan = _Plan(batch, q_len, num_heads, head_dim, kv_len=key.shape[1],
               num_kv_heads=key.shape[2],
               scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
               is_causal=is_causal, chunk=min(chunk_size, key.shape[1]))
  key = _pad_keys(key, plan.padded_len, axis=1)
  value = _pad_keys(value, plan.padded_len, axis=1)
  if not isinstance(bias, core.PositionBias):
    bias = _pad_keys(split_heads(bias, plan.num_kv_heads), plan.padded_len,
                     axis=-1)
  mask = _pad_keys(split_heads(mask, plan.num_kv_heads), plan.padded_len,
                   axis=-1)
  return _attend(plan, query, key, value, bias, mask)
