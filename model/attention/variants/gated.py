"""The gated linear-recurrent attentions: `retnet`, `mamba2`, `gla`,
`deltanet` and `gated_deltanet`, each recurrence.py's mechanism with its
own gate, delta step and parameters.

  variant         gate a_t (log a_t)                      delta step b_t
  retnet          1 - 2^(-5-h), fixed per head h          -
  mamba2          -exp(A_h) softplus(x w_h + dt_h),       -
                  a scalar per head, keys scaled by it
  gla             logsigmoid(x W_down W_up + c) / 16,     -
                  one per key dim
  deltanet        1                                       sigmoid(x w_h)
  gated_deltanet  mamba2's                                sigmoid(x w_h)

(RetNet: Sun et al. 2023; Mamba-2: Dao & Gu 2024; GLA: Yang et al. 2024;
DeltaNet: Schlag et al. 2021, Yang et al. 2024; Gated DeltaNet: Yang, Kautz
& Hatamizadeh 2025.) Gates and steps come from the layer's input x
[B, T, D] (the `inputs` the attention layer passes to a Variant that
`reads_inputs`), through the variant's parameters, initialised as the
papers do. The delta rule's queries and keys are L2-normalised per head
(its eigenvalues then stay in [-1, 1]). Queries are scaled by `scale`
(default 1 / sqrt(H)), and every variant's output is RMS-normalised per
head, as the papers' per-head group or RMS norms do (their gain is left to
the output projection). With fewer key/value heads than query heads, a
group's queries share its keys and values, each query head with its own
gate and state.

Short convolutions (the option `conv_width`, 4 in Mamba-2, GLA and the
DeltaNets; 0, the default, for none): the queries, keys and values are
each convolved along the positions, causally and per channel, then passed
through SiLU, before the recurrence reads them (and before the delta
rule's normalisation), as those papers do; RetNet has none, the option is
there for comparisons. A convolution never reads across a document start;
a dropped position (key padding) reads as zeros to the positions after
it. The model rotates queries and keys (rope) before the variant, so
under rope the convolution mixes rotated vectors: give these variants
learned or no positions where that matters.
"""

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention import core
from model.attention.core import logical_axes
from model.attention.variants import kernel, recurrence
from model.weight_decay import undecayed

Array = jax.Array


def _documents(mask, batch: int, length: int
               ) -> tuple[Array | None, Array | None]:
  """(keep [B, T], starts [B, T]) of a mask: the positions that count (a
  key padding mask's; None: all) and the document starts (a SegmentMask's
  runs; None: one document a row)."""
  if mask is None:
    return None, None
  if isinstance(mask, core.SegmentMask):
    if mask.kv_segment_ids_BxS is not None:
      raise ValueError('a recurrence reads packed rows of its own positions '
                       '(a SegmentMask without key ids).')
    ids = mask.q_segment_ids_BxT
    starts = jnp.concatenate([jnp.zeros((batch, 1), bool),
                              ids[:, 1:] != ids[:, :-1]], axis=1)
    return None, starts
  if isinstance(mask, core.PatternMask) or mask.shape[1] != 1 or (
      mask.shape[2] != 1):
    raise ValueError('a recurrence honours key padding masks ([B, 1, 1, S]) '
                     'and packed rows (a SegmentMask) only, not a mask of '
                     f'shape {mask.shape}.')
  return jnp.broadcast_to(mask[:, 0, 0], (batch, length)), None


class DecodingState(NamedTuple):
  """What a recurrence carries while decoding: its state [B, N, F, H]
  (float32) after the positions read so far and, with short convolutions
  of width W, the last W - 1 of those positions' queries, keys and values
  as they entered the convolutions (float32 [B, W - 1, N, H],
  [B, W - 1, K, H] twice; None without)."""

  memory: Array
  recent: tuple[Array, Array, Array] | None = None


def decoding_state(config, batch_size: int) -> DecodingState:
  """Zeros: the DecodingState before the first position, for a layer of
  `config` (a ModelConfig) decoding `batch_size` rows."""
  heads, kv_heads, head_dim = (config.num_heads, config.num_kv_heads,
                               config.head_dim)
  width = dict(config.attention_options).get('conv_width', 0)
  recent = None
  if width:
    recent = tuple(jnp.zeros((batch_size, width - 1, n, head_dim),
                             jnp.float32) for n in (heads, kv_heads, kv_heads))
  return DecodingState(jnp.zeros((batch_size, heads, head_dim, head_dim),
                                 jnp.float32), recent)


def _last_kept(x: Array, keep: Array | None, count: int) -> Array:
  """The last `count` positions of x [B, P, ...] that `keep` [B, P] holds
  (None: all), in order."""
  if keep is None:
    return x[:, x.shape[1] - count:]
  rank = jnp.cumsum(keep, axis=1)  # Of each kept position, from 1.
  wanted = rank[:, -1:] - count + 1 + jnp.arange(count)  # [B, count]
  pick = (rank[:, None, :] == wanted[..., None]) & keep[:, None, :]
  return jnp.einsum('brp,bp...->br...', pick.astype(x.dtype), x)


def short_convolution(x: Array, kernel: Array, *, keep: Array | None = None,
                      starts: Array | None = None,
                      recent: Array | None = None
                      ) -> tuple[Array, Array | None]:
  """(SiLU of the causal convolution of x [B, T, C, H] by kernel [W, C, H]
  along the positions, float32 [B, T, C, H]; with `recent`, the last W - 1
  inputs after this call's, else None).

  y_t = sum_i kernel[i] x_{t - W + 1 + i}: kernel[W - 1] weighs the
  position itself. keep [B, T] (None: all) zeroes the dropped positions'
  inputs; starts [B, T] (None: one document a row) stops each position's
  window at its document's start; recent [B, W - 1, C, H] holds the inputs
  before the first position (decoding's; None: zeros)."""
  batch, length = x.shape[:2]
  width = kernel.shape[0]
  x = x.astype(jnp.float32)
  if keep is not None:
    x = jnp.where(keep[..., None, None], x, 0.0)
  before = (jnp.zeros((batch, width - 1, *x.shape[2:]), jnp.float32)
            if recent is None else recent.astype(jnp.float32))
  padded = jnp.concatenate([before, x], axis=1)  # [B, W - 1 + T, C, H]
  # Each position's document, those before the call in the first.
  document = None if starts is None else jnp.pad(
      jnp.cumsum(starts, axis=1), ((0, 0), (width - 1, 0)))
  kernel = kernel.astype(jnp.float32)
  y = 0.0
  for i in range(width):
    tap = padded[:, i:i + length] * kernel[i]
    if document is not None and i < width - 1:
      same = document[:, i:i + length] == document[:, width - 1:]
      tap = jnp.where(same[..., None, None], tap, 0.0)
    y = y + tap
  if recent is None:
    return jax.nn.silu(y), None
  kept = None if keep is None else jnp.concatenate(
      [jnp.ones((batch, width - 1), bool), keep], axis=1)
  return jax.nn.silu(y), _last_kept(padded, kept, width - 1)


def _unit(x: Array) -> Array:
  """x / |x| over the last axis (0 for 0)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True),
                                       1e-12))


def recurrent_attention(name: str, query: Array, key: Array, value: Array,
                        bias: Array | None, mask, *, scale: float | None,
                        is_causal: bool, log_gate: Array,
                        beta: Array | None = None, unit_keys: bool = False,
                        key_scale: Array | None = None,
                        chunk_size: int | None = None,
                        convolution: tuple[Array, Array, Array] | None = None,
                        state: DecodingState | None = None
                        ) -> Array | tuple[Array, DecodingState]:
  """Attention `name` as a causal recurrence on the dense signature:
  query [B, T, N, H], key and value [B, T, K, H]; log_gate [B, T, N, G]
  (G = 1 or H), beta [B, T, N] (the delta rule) or None, key_scale
  [B, T, N] (a factor on each query head's keys) or None; queries and keys
  L2-normalised where `unit_keys`; convolution: the kernels [W, N, H],
  [W, K, H], [W, K, H] of the queries', keys' and values' short
  convolutions, or None. Out [B, T, N, H] in query's dtype; with `state`
  (the DecodingState before the first position), (out, the state after
  the last position)."""
  core.check_inputs(query, key, value, bias, mask)
  if bias is not None:
    raise ValueError(f'{name} attention cannot add a bias to logits it never '
                     'forms.')
  if not is_causal:
    raise ValueError(f'{name} attention is a causal recurrence; it needs '
                     'is_causal=True.')
  batch, length, heads, head_dim = query.shape
  dtype = query.dtype
  if key.shape[1] != length:
    raise ValueError(f'{name} attention needs query length {length} == key '
                     f'length {key.shape[1]}.')
  group = heads // key.shape[2]
  keep, starts = _documents(mask, batch, length)
  recent = None if state is None else state.recent
  if convolution is not None:
    if recent is None and state is not None:
      raise ValueError(f'{name} attention with short convolutions decodes '
                       'from a state that holds their recent inputs.')
    convolved = [short_convolution(x, w, keep=keep, starts=starts, recent=r)
                 for x, w, r in zip((query, key, value), convolution,
                                    recent or (None,) * 3)]
    (query, key, value), recent = zip(*convolved)
    recent = None if state is None else tuple(recent)
  q, k, v = (jnp.swapaxes(x, 1, 2).astype(jnp.float32)
             for x in (query, key, value))
  k, v = (jnp.repeat(x, group, axis=1) for x in (k, v))
  if unit_keys:
    q, k = _unit(q), _unit(k)
  q = q * (1.0 / math.sqrt(head_dim) if scale is None else scale)
  heads_first = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 2)
  g = heads_first(log_gate)
  b = None if beta is None else heads_first(beta)
  if key_scale is not None:
    k = k * heads_first(key_scale)[..., None]
  if keep is not None:  # A dropped position leaves the state as it was.
    keep = keep[:, None, :]
    k = jnp.where(keep[..., None], k, 0.0)
    g = jnp.where(keep[..., None], g, 0.0)
    b = None if b is None else jnp.where(keep, b, 0.0)
  initial = None if state is None else state.memory
  if length == 1 and starts is None:  # A decoding step.
    out, final = recurrence.steps(q, k, v, g, b, initial=initial)
  else:
    chunk = kernel.default_chunk_size() if chunk_size is None else chunk_size
    out, final = recurrence.chunked(q, k, v, g, b, starts=starts,
                                    initial=initial, chunk=chunk)
  out = out * jax.lax.rsqrt(jnp.mean(out * out, -1, keepdims=True) + 1e-6)
  out = jnp.swapaxes(out, 1, 2).astype(dtype)
  return out if state is None else (out, DecodingState(final, recent))


def _projected(inputs: Array, kernel_DxN: Array) -> Array:
  """inputs [B, T, D] @ kernel [D, ...] in float32."""
  return jnp.einsum('btd,d...->bt...', inputs.astype(jnp.float32),
                    kernel_DxN.astype(jnp.float32))


def retention_log_decays(num_heads: int) -> Array:
  """RetNet's log decays [N], log(1 - 2^(-5 - h)) for heads h = 0..N-1."""
  return jnp.log1p(-2.0 ** (-5.0 - jnp.arange(num_heads)))


def retnet_attention(query: Array, key: Array, value: Array,
                     bias: Array | None = None, mask=None, *,
                     scale: float | None = None, is_causal: bool = False,
                     chunk_size: int | None = None,
                     convolution: tuple[Array, Array, Array] | None = None,
                     state: DecodingState | None = None
                     ) -> Array | tuple[Array, DecodingState]:
  """Retention (Sun et al. 2023): a fixed decay per head, no parameters
  (but those of short convolutions, where asked for).

  Args:
    chunk_size: positions per chunk (default kernel.default_chunk_size()).
    convolution: the short convolutions' kernels (conv_parameters), or None.
    state: decoding's DecodingState before the first position; given, the
      return is (out, the state after the last position).
  """
  heads = query.shape[2]
  log_gate = jnp.broadcast_to(retention_log_decays(heads)[:, None],
                              (*query.shape[:2], heads, 1))
  return recurrent_attention('retnet', query, key, value, bias, mask,
                             scale=scale, is_causal=is_causal,
                             log_gate=log_gate, chunk_size=chunk_size,
                             convolution=convolution, state=state)


def _ssm_log_gate(inputs: Array, dt_kernel: Array, dt_bias: Array,
                  a_log: Array) -> tuple[Array, Array]:
  """(log a_t [B, T, N, 1], dt [B, T, N]) of Mamba-2's discretisation:
  dt = softplus(x w + dt_bias), log a_t = -exp(a_log) dt."""
  dt = jax.nn.softplus(_projected(inputs, dt_kernel)
                       + dt_bias.astype(jnp.float32))
  return (-jnp.exp(a_log.astype(jnp.float32)) * dt)[..., None], dt


def mamba2_attention(query: Array, key: Array, value: Array,
                     bias: Array | None = None, mask=None, *,
                     scale: float | None = None, is_causal: bool = False,
                     inputs: Array, dt_kernel: Array, dt_bias: Array,
                     a_log: Array, chunk_size: int | None = None,
                     convolution: tuple[Array, Array, Array] | None = None,
                     state: DecodingState | None = None
                     ) -> Array | tuple[Array, DecodingState]:
  """Mamba-2's SSD (Dao & Gu 2024) on queries (C), keys (B) and values
  (x): S_t = a_t S_{t-1} + dt_t k_t v_t^T, a scalar decay per head.

  Args:
    inputs: the layer's input x [B, T, D].
    dt_kernel, dt_bias, a_log: [D, N], [N], [N] (see ssm_parameters).
    chunk_size: positions per chunk (default kernel.default_chunk_size()).
    convolution: the short convolutions' kernels (conv_parameters), or None.
    state: decoding's DecodingState before the first position; given, the
      return is (out, the state after the last position).
  """
  log_gate, dt = _ssm_log_gate(inputs, dt_kernel, dt_bias, a_log)
  return recurrent_attention('mamba2', query, key, value, bias, mask,
                             scale=scale, is_causal=is_causal,
                             log_gate=log_gate, key_scale=dt,
                             chunk_size=chunk_size, convolution=convolution,
                             state=state)


def gla_attention(query: Array, key: Array, value: Array,
                  bias: Array | None = None, mask=None, *,
                  scale: float | None = None, is_causal: bool = False,
                  inputs: Array, gate_down: Array, gate_up: Array,
                  gate_bias: Array, gate_temperature: float = 16.0,
                  chunk_size: int | None = None,
                  convolution: tuple[Array, Array, Array] | None = None,
                  state: DecodingState | None = None
                  ) -> Array | tuple[Array, DecodingState]:
  """Gated linear attention (Yang et al. 2024): a decay per key dim,
  log a_t = logsigmoid(x W_down W_up + c) / gate_temperature, a low-rank
  gate.

  Args:
    inputs: the layer's input x [B, T, D].
    gate_down, gate_up, gate_bias: [D, R], [R, N, H], [N, H] (see
      gla_parameters).
    gate_temperature: the divisor of the log gate (16 in the paper: gates
      near 1 at the start).
    chunk_size: positions per chunk (default kernel.default_chunk_size()).
    convolution: the short convolutions' kernels (conv_parameters), or None.
    state: decoding's DecodingState before the first position; given, the
      return is (out, the state after the last position).
  """
  if gate_temperature <= 0:
    raise ValueError(f'gate_temperature={gate_temperature} must be positive.')
  logits = _projected(_projected(inputs, gate_down), gate_up.reshape(
      gate_up.shape[0], -1)).reshape(*inputs.shape[:2], *gate_up.shape[1:])
  log_gate = jax.nn.log_sigmoid(
      logits + gate_bias.astype(jnp.float32)) / gate_temperature
  return recurrent_attention('gla', query, key, value, bias, mask,
                             scale=scale, is_causal=is_causal,
                             log_gate=log_gate, chunk_size=chunk_size,
                             convolution=convolution, state=state)


def deltanet_attention(query: Array, key: Array, value: Array,
                       bias: Array | None = None, mask=None, *,
                       scale: float | None = None, is_causal: bool = False,
                       inputs: Array, beta_kernel: Array,
                       chunk_size: int | None = None,
                       convolution: tuple[Array, Array, Array] | None = None,
                       state: DecodingState | None = None
                       ) -> Array | tuple[Array, DecodingState]:
  """DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule
  S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, b_t = sigmoid(x w).

  Args:
    inputs: the layer's input x [B, T, D].
    beta_kernel: w [D, N].
    chunk_size: positions per chunk (default kernel.default_chunk_size()).
    convolution: the short convolutions' kernels (conv_parameters), or None.
    state: decoding's DecodingState before the first position; given, the
      return is (out, the state after the last position).
  """
  log_gate = jnp.zeros((*query.shape[:3], 1), jnp.float32)
  return recurrent_attention(
      'deltanet', query, key, value, bias, mask, scale=scale,
      is_causal=is_causal, log_gate=log_gate,
      beta=jax.nn.sigmoid(_projected(inputs, beta_kernel)), unit_keys=True,
      chunk_size=chunk_size, convolution=convolution, state=state)


def gated_deltanet_attention(query: Array, key: Array, value: Array,
                             bias: Array | None = None, mask=None, *,
                             scale: float | None = None,
                             is_causal: bool = False, inputs: Array,
                             beta_kernel: Array, dt_kernel: Array,
                             dt_bias: Array, a_log: Array,
                             chunk_size: int | None = None,
                             convolution: tuple[Array, Array, Array]
                             | None = None,
                             state: DecodingState | None = None
                             ) -> Array | tuple[Array, DecodingState]:
  """Gated DeltaNet (Yang, Kautz & Hatamizadeh 2025): the delta rule under
  Mamba-2's decay, S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T.

  Args:
    inputs: the layer's input x [B, T, D].
    beta_kernel: [D, N]; dt_kernel, dt_bias, a_log: [D, N], [N], [N].
    chunk_size: positions per chunk (default kernel.default_chunk_size()).
    convolution: the short convolutions' kernels (conv_parameters), or None.
    state: decoding's DecodingState before the first position; given, the
      return is (out, the state after the last position).
  """
  log_gate, _ = _ssm_log_gate(inputs, dt_kernel, dt_bias, a_log)
  return recurrent_attention(
      'gated_deltanet', query, key, value, bias, mask, scale=scale,
      is_causal=is_causal, log_gate=log_gate,
      beta=jax.nn.sigmoid(_projected(inputs, beta_kernel)), unit_keys=True,
      chunk_size=chunk_size, convolution=convolution, state=state)


def _uniform(low: float, high: float):
  def init(rng, shape, dtype):
    return jax.random.uniform(rng, shape, dtype, low, high)
  return init


def _dt_bias(rng, shape, dtype):
  """softplus^-1 of dt drawn log-uniformly in [1e-3, 1e-1] (Mamba)."""
  dt = jnp.exp(jax.random.uniform(rng, shape, jnp.float32, math.log(1e-3),
                                  math.log(1e-1)))
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _heads_kernel(module: nn.Module, config, name: str) -> Array:
  """A projection [D, N] of the input to one number per query head (its
  output axis unnamed, as a router's: a gate, not a hidden matrix)."""
  return module.param(name, nn.with_logical_partitioning(
      nn.initializers.lecun_normal(), ('embed', None)),
                      (config.d_model, config.num_heads), config.weight_dtype)


def _conv_init(rng, shape, dtype):
  """PyTorch's Conv1d default for a per-channel kernel [W, ...] (as the
  papers' code): uniform in +-1 / sqrt(W)."""
  bound = 1.0 / math.sqrt(shape[0])
  return jax.random.uniform(rng, shape, dtype, -bound, bound)


def conv_parameters(module: nn.Module, config, *, conv_width: int = 0,
                    **options) -> dict[str, Any]:
  """The short convolutions' kernels, in `module` for a layer of `config`:
  `convolution` = (conv_query [W, N, H], conv_key [W, K, H], conv_value
  [W, K, H]) for W = `conv_width` (0: None, no convolutions); with the
  other `options`."""
  if conv_width == 0:
    return options | {'convolution': None}
  if conv_width < 2:
    raise ValueError(f'conv_width={conv_width} must be 0 (none) or at least '
                     '2 (a width of 1 mixes no positions).')
  def kernel(name, heads, axis):
    return module.param(name, nn.with_logical_partitioning(
        _conv_init, (None, axis, 'kv')), (conv_width, heads, config.head_dim),
                        config.weight_dtype)
  return options | {'convolution': (
      kernel('conv_query', config.num_heads, logical_axes.HEADS),
      kernel('conv_key', config.num_kv_heads, logical_axes.KV_HEADS),
      kernel('conv_value', config.num_kv_heads, logical_axes.KV_HEADS))}


def _ssm_decay(module: nn.Module, config) -> dict[str, Array]:
  """Mamba-2's decay: dt_kernel [D, N] (as the projections), dt_bias [N]
  (softplus of it log-uniform in [1e-3, 1e-1]) and a_log [N] (log of A
  uniform in [1, 16]), the last two not decayed."""
  heads = (config.num_heads,)
  return {
      'dt_kernel': _heads_kernel(module, config, 'dt_kernel'),
      'dt_bias': module.param('dt_bias', undecayed(_dt_bias, ('heads',)),
                              heads, config.weight_dtype),
      'a_log': module.param(
          'a_log', undecayed(lambda rng, shape, dtype: jnp.log(
              _uniform(1.0, 16.0)(rng, shape, dtype)), ('heads',)),
          heads, config.weight_dtype)}


def ssm_parameters(module: nn.Module, config, *, conv_width: int = 0,
                   **options) -> dict[str, Any]:
  """Mamba-2's, in `module` for a layer of `config` (a ModelConfig): its
  decay's and the short convolutions' (conv_parameters); with the other
  `options`."""
  return conv_parameters(module, config, conv_width=conv_width,
                         **options) | _ssm_decay(module, config)


def delta_parameters(module: nn.Module, config, *, conv_width: int = 0,
                     **options) -> dict[str, Any]:
  """DeltaNet's: beta_kernel [D, N] and the short convolutions'."""
  return conv_parameters(module, config, conv_width=conv_width,
                         **options) | {
                             'beta_kernel': _heads_kernel(module, config,
                                                          'beta_kernel')}


def gated_delta_parameters(module: nn.Module, config, *, conv_width: int = 0,
                           **options) -> dict[str, Any]:
  """Gated DeltaNet's: the delta step's, the short convolutions' and
  Mamba-2's decay's."""
  return delta_parameters(module, config, conv_width=conv_width,
                          **options) | _ssm_decay(module, config)


def gla_parameters(module: nn.Module, config, *, gate_rank: int = 16,
                   conv_width: int = 0, **options) -> dict[str, Any]:
  """GLA's low-rank gate, in `module` for a layer of `config`: gate_down
  [D, R], gate_up [R, N, H] (R = `gate_rank`, 16 in the paper) and
  gate_bias [N, H] (zeros, not decayed); and the short convolutions'."""
  if gate_rank < 1:
    raise ValueError(f'gate_rank={gate_rank} must be positive.')
  heads = (config.num_heads, config.head_dim)
  lecun = nn.initializers.lecun_normal()
  return conv_parameters(module, config, conv_width=conv_width,
                         **options) | {
      'gate_down': module.param(
          'gate_down', nn.with_logical_partitioning(lecun, ('embed', None)),
          (config.d_model, gate_rank), config.weight_dtype),
      'gate_up': module.param(
          'gate_up', nn.with_logical_partitioning(
              nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)),
              (None, 'heads', 'kv')),
          (gate_rank, *heads), config.weight_dtype),
      'gate_bias': module.param(
          'gate_bias', undecayed(nn.initializers.zeros, ('heads', 'kv')),
          heads, config.weight_dtype)}
