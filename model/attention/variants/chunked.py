"""`chunked`: exact attention a block of queries and a chunk of keys at a
time, with an online softmax.

The memory-efficient attention of Rabe & Staats (2021), in the blocked form
of FlashAttention (Dao et al. 2022; Dao 2023). For each block of queries the
chunks of keys are visited in turn; each query keeps a running maximum
logit, a running sum of exponentials and a running weighted sum of values.
Logits exist for one block at a time, so memory is O(T * H) besides a block
of [query block, key chunk] logits, rather than O(T * S). Causal attention
visits only the blocks on or below the diagonal: about half the work of the
dense product at long lengths. A custom VJP saves only the output and each
query's log-sum-exp, and recomputes each block's weights in the backward
pass, which visits the same blocks. Any T and S work: the last block and
chunk are padded with masked queries and keys.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from model.attention import core
from model.attention.core import online_softmax
from model.attention.kernels import fused
from model.attention.variants import chunk_plan

Array = jax.Array


def _fori_loop(plan: chunk_plan.Plan, lower, upper, body, init):
  """`lax.fori_loop`, or the same loop unrolled (Python int indices) where
  `plan.unrolled`."""
  if plan.unrolled:
    for index in range(int(lower), int(upper)):
      init = body(index, init)
    return init
  return jax.lax.fori_loop(lower, upper, body, init)


def _scan(plan: chunk_plan.Plan, body, carry, xs):
  """`lax.scan` over numpy `xs`, or the same loop unrolled where
  `plan.unrolled`."""
  if not plan.unrolled:
    return jax.lax.scan(body, carry, xs)
  outputs = []
  for inputs in zip(*xs):
    carry, output = body(carry, tuple(int(x) for x in inputs))
    outputs.append(output)
  return carry, jax.tree.map(lambda *x: jnp.stack(x), *outputs)


def _forward(plan: chunk_plan.Plan, query, key, value, bias, mask, sinks):
  """Output [B, K, G, padded T, H] and log-sum-exp [B, K, G, padded T]
  (+inf for rows that see no key), each row's sink logit (sinks [N], or
  None) counted in it."""
  q = plan.queries(query)

  def query_block(_, inputs):
    q_index, chunks_seen = inputs
    q_block = plan.query_block(q, q_index)

    def visit(kv_index, stats):
      logits = plan.logits(q_block, plan.key_chunk(key, kv_index), bias,
                           mask, q_index, kv_index)
      return online_softmax.step(stats, logits, plan.key_chunk(value,
                                                               kv_index))

    stats = _fori_loop(
        plan, 0, chunks_seen, visit,
        online_softmax.init(
            (plan.batch, plan.num_kv_heads, plan.group, plan.q_chunk),
            plan.head_dim,
            online_softmax.sinks_by_group(sinks, plan.num_kv_heads)))
    return None, online_softmax.result(stats)

  _, (out, log_sum_exp) = _scan(
      plan, query_block, None,
      (np.arange(plan.num_q_chunks), plan.key_chunks_seen()))
  return plan.join_queries(out), plan.join_queries(log_sum_exp)


def _to_output(plan: chunk_plan.Plan, out_BxKxGxTxH: Array, dtype) -> Array:
  """[B, K, G, padded T, H] -> [B, T, N, H]."""
  out = jnp.transpose(out_BxKxGxTxH[:, :, :, :plan.q_len], (0, 3, 1, 2, 4))
  return out.reshape(plan.batch, plan.q_len, plan.num_heads,
                     plan.head_dim).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan, query, key, value, bias, mask, sinks):
  out, _ = _forward(plan, query, key, value, bias, mask, sinks)
  return _to_output(plan, out, query.dtype)


def _attend_fwd(plan, query, key, value, bias, mask, sinks):
  out, log_sum_exp = _forward(plan, query, key, value, bias, mask, sinks)
  residuals = (query, key, value, bias, mask, sinks, out, log_sum_exp)
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
  """Each chunk of keys in turn, with the blocks of queries that see it:
  its key and value gradients in the loop's carry, the query (and bias)
  gradients accumulated block by block in place."""
  query, key, value, bias, mask, sinks, out, log_sum_exp = residuals
  q = plan.queries(query)
  d_out_5 = plan.queries(d_out)
  # D_i = sum_h dO_ih O_ih: the softmax backward's per-row correction.
  correction = jnp.sum(d_out_5 * out, axis=-1)
  d_sinks = None
  if sinks is not None:  # A key of value 0: -sum_i p_sink,i D_i.
    sink_weights = jnp.exp(online_softmax.sinks_by_group(
        sinks, plan.num_kv_heads) - log_sum_exp)
    d_sinks = -jnp.sum(sink_weights * correction, axis=(0, 3)).reshape(
        sinks.shape).astype(sinks.dtype)
  position_bias = isinstance(bias, core.PositionBias)
  if position_bias:
    d_bias = jax.tree.map(jnp.zeros_like, bias.data)
  elif bias is not None:
    d_bias = jnp.zeros(bias.shape, jnp.float32)
  else:
    d_bias = None

  def key_chunk(carry, inputs):
    kv_index, first_block = inputs
    k_c = plan.key_chunk(key, kv_index).astype(jnp.float32)
    v_c = plan.key_chunk(value, kv_index).astype(jnp.float32)

    def visit(q_index, inner):
      d_query, d_key, d_value, d_bias = inner
      q_block = plan.query_block(q, q_index)
      d_out_block = plan.query_block(d_out_5, q_index)
      scores = plan.scores(q_block, k_c)
      if position_bias:  # The score function's pull-back: to s and data.
        logits, pull_back = jax.vjp(
            lambda s, data: plan.masked(
                s, dataclasses.replace(bias, data=data), mask, q_index,
                kv_index), scores, bias.data)
      else:
        logits = plan.masked(scores, bias, mask, q_index, kv_index)
      weights = jnp.exp(logits - plan.query_block(log_sum_exp, q_index)[
          ..., None])
      d_value = d_value + jnp.einsum('bkgqc,bkgqh->bckh', weights,
                                     d_out_block)
      d_weights = jnp.einsum('bkgqh,bckh->bkgqc', d_out_block, v_c)
      d_logits = weights * (d_weights - plan.query_block(
          correction, q_index)[..., None])
      d_scores = d_logits
      if position_bias:
        d_scores, d_data = pull_back(d_logits)
        d_bias = _add_inexact(d_bias, d_data)
      elif bias is not None:
        d_bias = chunk_plan.add_block(
            d_bias, _reduce_to(d_logits, plan.bias_block(
                bias, q_index, kv_index).shape),
            plan.starts(q_index, kv_index))
      if plan.logit_cap:  # Through cap * tanh(s / cap): 1 - tanh^2.
        d_scores = d_scores * (1 - (scores / plan.logit_cap) ** 2)
      d_query = jax.lax.dynamic_update_slice_in_dim(
          d_query, plan.query_block(d_query, q_index) + plan.scale
          * jnp.einsum('bkgqc,bckh->bkgqh', d_scores, k_c),
          q_index * plan.q_chunk, axis=3)
      d_key = d_key + plan.scale * jnp.einsum('bkgqc,bkgqh->bckh', d_scores,
                                              q_block)
      return d_query, d_key, d_value, d_bias

    d_query, d_bias = carry
    zeros = jnp.zeros(k_c.shape, jnp.float32)
    d_query, d_key, d_value, d_bias = _fori_loop(
        plan, first_block, plan.num_q_chunks, visit,
        (d_query, zeros, zeros, d_bias))
    return (d_query, d_bias), (d_key, d_value)

  (d_query, d_bias), (d_key, d_value) = _scan(
      plan, key_chunk, (jnp.zeros_like(q), d_bias),
      (np.arange(plan.num_kv_chunks), plan.first_query_block()))

  def join_chunks(x):  # [chunks, B, C, K, H] -> [B, chunks * C, K, H]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])

  if position_bias:
    d_bias = dataclasses.replace(
        bias, data=_zero_integers(bias.data, d_bias))
  elif d_bias is not None:
    d_bias = d_bias.astype(bias.dtype)
  return (_to_output(plan, d_query, query.dtype),
          join_chunks(d_key).astype(key.dtype),
          join_chunks(d_value).astype(value.dtype), d_bias, None, d_sinks)


_attend.defvjp(_attend_fwd, _attend_bwd)


def default_chunk_size(batch: int, num_heads: int, q_len: int,
                       kv_len: int) -> int:
  """Keys per chunk (and queries per block) for the backend. On CPU, short
  sequences take the smallest blocks, from 64, whose loops unroll (see
  `chunk_plan.unrolls`); longer ones the largest power of two up to 512
  whose block of logits over every example and head fits 8 MiB of cache
  (512 for B=1, N=8; 128 for B=8, N=8). experiments/bench_attention.py and
  bench_train.py measured these choices. Elsewhere 512."""
  if jax.default_backend() != 'cpu':
    return 512
  for chunk in (64, 128, 256, 512):
    if chunk_plan.unrolls(batch, num_heads, q_len, kv_len, min(chunk, q_len),
                min(chunk, kv_len)):
      return chunk
  chunk = 512
  while chunk > 64 and batch * num_heads * chunk * chunk * 4 > 8 * 2**20:
    chunk //= 2
  return chunk


def chunked_attention(query: Array, key: Array, value: Array,
                      bias: Array | None = None, mask: Array | None = None, *,
                      scale: float | None = None, is_causal: bool = False,
                      chunk_size: int | None = None,
                      query_chunk_size: int | None = None,
                      kernel: str = 'auto', logit_cap: float = 0.0,
                      sinks: Array | None = None) -> Array:
  """`scaled_dot_product_attention`, exactly, in O(T * H) memory besides a
  block of logits: by the blocked JAX code here, or by a fused kernel that
  computes the same blocked algorithm (model/attention/kernels/fused.py).

  Args:
    chunk_size: keys per chunk of the JAX code; None for
      `default_chunk_size`.
    query_chunk_size: its queries per block; None for chunk_size.
    kernel: one of fused.KERNELS: 'xla' for the JAX code, a fused kernel
      by name (KernelError where it cannot compute the case), or 'auto'
      for the fastest that can on this backend.
    logit_cap, sinks: as `scaled_dot_product_attention`'s.
  """
  return attend(query, key, value, bias, mask, scale=scale,
                is_causal=is_causal, chunk_size=chunk_size,
                query_chunk_size=query_chunk_size, kernel=kernel,
                logit_cap=logit_cap, sinks=sinks)


def attend(query: Array, key: Array, value: Array, bias, mask, *,
           scale: float | None, is_causal: bool, kernel: str,
           chunk_size: int | None = None,
           query_chunk_size: int | None = None, logit_cap: float = 0.0,
           pattern=None, sinks: Array | None = None) -> Array:
  """`chunked_attention` over the pairs a pattern allows too (patterns.py's
  interface; None: every pair): on the fused kernel chosen for the case,
  or by the JAX code under the pattern as a core.PatternMask."""
  core.check_inputs(query, key, value, bias, mask)
  core.check_logit_cap(logit_cap)
  core.check_sinks(sinks, query.shape[2])
  for name, size in (('chunk_size', chunk_size),
                     ('query_chunk_size', query_chunk_size)):
    if size is not None and size < 1:
      raise ValueError(f'{name}={size} must be positive.')
  batch, q_len, num_heads, head_dim = query.shape
  scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
  kernel = fused.choose(kernel, fused.case_of(
      query, key, bias, mask, is_causal=is_causal, pattern=pattern,
      logit_cap=logit_cap, sinks=sinks))
  if kernel != 'xla':
    return fused.run(kernel, query, key, value, bias, mask, scale=scale,
                     is_causal=is_causal, pattern=pattern,
                     logit_cap=logit_cap, sinks=sinks)
  if pattern is not None:
    mask = core.PatternMask(mask, pattern)
  chunk_size = chunk_size or default_chunk_size(batch, num_heads, q_len,
                                                key.shape[1])
  plan = chunk_plan.Plan(batch, q_len, num_heads, head_dim, kv_len=key.shape[1],
               num_kv_heads=key.shape[2], scale=scale, is_causal=is_causal,
               q_chunk=min(query_chunk_size or chunk_size, q_len),
               kv_chunk=min(chunk_size, key.shape[1]), logit_cap=logit_cap)
  pad, split = chunk_plan.pad, online_softmax.split_heads
  key = pad(key, 1, plan.padded_kv_len)
  value = pad(value, 1, plan.padded_kv_len)
  if not isinstance(bias, core.PositionBias):
    bias = pad(pad(split(bias, plan.num_kv_heads), -1, plan.padded_kv_len),
               -2, plan.padded_q_len)

  def padded(mask):
    if isinstance(mask, core.PatternMask):
      return dataclasses.replace(mask, mask=padded(mask.mask))
    if isinstance(mask, core.SegmentMask):
      return core.SegmentMask(pad(mask.q_segment_ids_BxT, 1,
                                  plan.padded_q_len),
                              pad(mask.kv_ids, 1, plan.padded_kv_len))
    return pad(pad(split(mask, plan.num_kv_heads), -1, plan.padded_kv_len),
               -2, plan.padded_q_len)

  return _attend(plan, query, key, value, bias, padded(mask), sinks)
