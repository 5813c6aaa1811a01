"""The dense attention core: pure functions, no parameters, no state.

Layout follows `jax.nn.dot_product_attention`:
  query  [B, T, N, H]   batch, query length, query heads, head dim
  key    [B, S, K, H]   batch, key length, key/value heads, head dim
  value  [B, S, K, H]
  output [B, T, N, H]
K divides N: K == N is multi-head attention, 1 < K < N grouped-query
attention (Ainslie et al. 2023), K == 1 multi-query attention (Shazeer 2019).
Query head n reads key/value head n // (N // K).

Masks are boolean, True = attend, with shape broadcastable to [B, N, T, S]
(or a SegmentMask, compared where it is needed); a bias of the same shape
(or a PositionBias, computed where it is needed) is added to the logits.
Logits and softmax are float32 whatever the input dtype; the output has the
query's dtype.

The room's other modules are what the kernels and the variants share
besides: the online softmax (online_softmax.py), block patterns
(patterns.py) and the logical axis names (logical_axes.py). It imports
nothing of the project.
"""

from collections.abc import Callable
import dataclasses
import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


# The roles an axis of a score function's data plays (PositionBias.axes);
# None: a free axis (a table's rows).
ROLES = ('batch', 'head', 'query', 'key', None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PositionBias:
  """A score function: the logits of the (query, key) pairs as a function
  of their scores s = q . k * scale, their indices and the head, given as
  that function rather than as a bias array [B, N, T, S] (FlexAttention's
  score_mod). A variant that visits blocks of pairs evaluates it on those
  blocks only, and the fused kernels (flex.py) inside their tiles.

  fn(s, data, q_index, k_index, head) -> float32 logits of s's shape, for
  one example and one query head: s float32 [*I], I the broadcast shape of
  the int32 index arrays q_index and k_index (within a kernel's tile, [bq,
  1] and [1, bk]), head an int32 scalar (the index along the data's head
  axes: under a mesh that splits the heads, a device's own), and `data`
  the entries of `data` as this example and head read them: an axis of
  role 'query' indexed by q_index and one of role 'key' by k_index (so
  positions [B, T] come as [*I]-broadcastable arrays), free axes (None)
  leading. An additive bias returns s + bias.

  `axes` names, for each entry of `data`, the role of each of its axes
  (ROLES): e.g. {'q_positions': ('batch', 'query'), 'slopes': ('head',),
  'table': (None, 'head')}; a 'batch' or 'head' axis of size 1 is
  broadcast. The float entries are differentiated. A fused kernel computes
  a score function whose entries are, beside their batch and head axes,
  integer per-token arrays (one 'query' or 'key' axis), or float scalars
  and tables (no axis, or one free axis: read with `lookup` or a constant
  index); others (Shaw's and DeBERTa's scores of the queries and keys) run
  in XLA only (`kernel_ready`).
  """

  data: dict[str, Any]
  fn: Callable[..., Array] = dataclasses.field(metadata={'static': True})
  axes: Any = dataclasses.field(metadata={'static': True})
  # What it is called in a kernel's choice (fused.Case.describe).
  name: str = dataclasses.field(default='a position bias',
                                metadata={'static': True})

  def __post_init__(self):
    if isinstance(self.axes, dict):  # Hashable, as a static field must be.
      object.__setattr__(self, 'axes', tuple(sorted(
          (name, tuple(roles)) for name, roles in self.axes.items())))

  def roles(self, name: str) -> tuple[str | None, ...]:
    return dict(self.axes)[name]

  def check(self) -> None:
    """ValueError unless every entry's axes are named, once each."""
    named = dict(self.axes)
    if set(named) != set(self.data):
      raise ValueError(f'{self.name}: axes names {sorted(named)}, data '
                       f'holds {sorted(self.data)}; they must be the same.')
    for name, roles in named.items():
      shape = jnp.shape(self.data[name])
      bad = [role for role in roles if role not in ROLES]
      once = [role for role in ROLES[:4] if roles.count(role) > 1]
      if len(roles) != len(shape) or bad or once:
        raise ValueError(
            f'{self.name}: data[{name!r}] has shape {shape} and axes '
            f'{roles}; give one role of {ROLES} per axis, each of '
            f'{ROLES[:4]} at most once.')

  @property
  def kernel_ready(self) -> bool:
    """Whether a fused kernel can compute it: each entry, beside its batch
    and head axes, a per-token array (its one axis 'query' or 'key'), a
    scalar or a table (one free axis)."""
    return all(free_roles(roles) in ((), (None,), ('query',), ('key',))
               for _, roles in self.axes)

  def apply(self, s_BxNxI: Array, q_index, k_index) -> Array:
    """The logits [B, N, *I] of scores s [B, N, *I] at index pairs that
    broadcast to I: fn for each example and head (vmapped)."""
    batch, heads = s_BxNxI.shape[:2]
    data, by_example, by_head = {}, {}, {}
    for name, roles in self.axes:
      x, roles = jnp.asarray(self.data[name]), list(roles)
      for role, size, axes in (('batch', batch, by_example),
                               ('head', heads, by_head)):
        axes[name] = None
        if role in roles:
          x = jnp.moveaxis(x, roles.index(role), 0)
          roles.insert(0, roles.pop(roles.index(role)))
          if x.shape[0] not in (1, size):
            raise ValueError(
                f'{self.name}: data[{name!r}] has {x.shape[0]} along its '
                f'{role} axis, the scores {size}.')
          if x.shape[0] == size and size > 1:
            axes[name] = 0
          else:
            x, _ = x[0], roles.pop(0)
      # Batch leads, then the head: each vmap below takes axis 0.
      if by_example[name] == 0 and by_head[name] == 0:
        x = jnp.swapaxes(x, 0, 1)
      data[name] = (x, tuple(roles[(by_example[name] == 0)
                                   + (by_head[name] == 0):]))

    def one(s_I, arrays, head):
      views = {name: _view(arrays[name], data[name][1], q_index, k_index)
               for name in arrays}
      return self.fn(s_I, views, q_index, k_index, head).astype(jnp.float32)

    arrays = {name: x for name, (x, _) in data.items()}
    over_heads = jax.vmap(one, in_axes=(0, by_head, 0))
    return jax.vmap(over_heads, in_axes=(0, by_example, None))(
        s_BxNxI.astype(jnp.float32), arrays,
        jnp.arange(heads, dtype=jnp.int32))

  def at(self, q_index, k_index) -> Array:
    """The logits of scores 0, [B, N, *I] (B and N as the data's axes
    have them, else 1: a function that reads `head` of no data then sees
    head 0 only): the bias an additive score function adds."""
    sizes = {role: 1 for role in ('batch', 'head')}
    for name, roles in self.axes:
      for role in sizes:
        if role in roles:
          sizes[role] = max(sizes[role],
                            jnp.shape(self.data[name])[roles.index(role)])
    shape = np.broadcast_shapes(np.shape(q_index), np.shape(k_index))
    return self.apply(jnp.zeros((sizes['batch'], sizes['head'], *shape)),
                      q_index, k_index)


def free_roles(roles) -> tuple[str | None, ...]:
  """A data entry's roles but its batch and head axes: ('query',) or
  ('key',) for a per-token entry, (None,) for a table, () for a scalar."""
  return tuple(role for role in roles if role not in ('batch', 'head'))


def _view(x: Array, roles, q_index, k_index) -> Array:
  """An entry of one example and head (its `roles` those left) at the
  pairs: its query axis read at q_index, its key axis at k_index, free
  axes leading."""
  order = ([i for i, role in enumerate(roles) if role is None]
           + [roles.index(role) for role in ('query', 'key')
              if role in roles])
  x = jnp.transpose(x, order)
  index = tuple(i for role, i in (('query', q_index), ('key', k_index))
                if role in roles)
  return x[(Ellipsis, *index)] if index else x


def lookup(table, index: Array) -> Array:
  """table[index]: a score function's free-axis entry (a table) read at an
  int array of rows, as XLA gathers it and as a fused kernel computes it
  (where the table comes as a tuple of scalars: a sum of selects, whose
  gradient is a sum per row)."""
  if isinstance(table, tuple):  # Out of range reads the nearest row.
    index = jnp.clip(index, 0, len(table) - 1)
    return sum(jnp.where(index == row, value, 0.0)
               for row, value in enumerate(table))
  return jnp.take(table, index, mode='clip')


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentMask:
  """True where query and key belong to the same packed sequence, given by
  each token's segment id rather than as a [B, 1, T, S] array.

  A variant that visits blocks of pairs compares the ids of those blocks
  only, so packed rows never make it build the whole mask. Without key ids
  the keys are the queries' own positions (self-attention over packed rows),
  and every query sees at least itself: what the fused kernels need.
  `max_segments`, where the data bounds it, is the most runs of one id
  (padding included) a row holds: cuDNN's packed layout is sized by it.
  """

  q_segment_ids_BxT: Array
  kv_segment_ids_BxS: Array | None = None
  max_segments: int | None = dataclasses.field(default=None,
                                               metadata={'static': True})

  @property
  def kv_ids(self) -> Array:
    """The keys' ids [B, S]: the queries' own without key ids."""
    if self.kv_segment_ids_BxS is None:
      return self.q_segment_ids_BxT
    return self.kv_segment_ids_BxS

  @property
  def shape(self) -> tuple[int, int, int, int]:
    """The shape of the mask it stands for, [B, 1, T, S]."""
    batch, q_len = self.q_segment_ids_BxT.shape
    return batch, 1, q_len, self.kv_ids.shape[1]

  def at(self, q_index, k_index) -> Array:
    """bool [B, 1, *I] at pairs (q_index, k_index) of broadcast shape I."""
    return (self.q_segment_ids_BxT[:, q_index]
            == self.kv_ids[:, k_index])[:, None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PatternMask:
  """True where a pattern allows the pair (`pattern.allowed(q, k)` on
  query and key positions that broadcast, jax arrays: patterns.py's
  interface) and `mask` (None, an array broadcastable to [B, N, T, S] or
  a SegmentMask) does; evaluated on the pairs a variant visits, never as
  a whole [T, S] array."""

  mask: Any = None
  pattern: Any = dataclasses.field(default=None, metadata={'static': True})

  def at(self, q_index, k_index) -> Array:
    """bool [B?, N?, *I] at pairs (q_index, k_index) of broadcast shape I."""
    allowed = jnp.asarray(self.pattern.allowed(q_index, k_index))[None, None]
    if self.mask is None:
      return allowed
    return mask_at(self.mask, q_index, k_index) & allowed


def chained(first: 'PositionBias', then) -> 'PositionBias':
  """The score function `first`, then `then` (a PositionBias, e.g. the
  model's position bias; None for none) on its logits: one PositionBias
  whose data are both's, named apart."""
  if then is None:
    return first
  if not isinstance(then, PositionBias):
    raise ValueError(f'{first.name} takes a position bias beside it, not a '
                     'bias array.')
  parts = (('0', first), ('1', then))

  def score(s, data, q_index, k_index, head):
    for prefix, part in parts:
      s = part.fn(s, {name: data[f'{prefix}.{name}'] for name in part.data},
                  q_index, k_index, head)
    return s

  return PositionBias(
      {f'{prefix}.{name}': x for prefix, part in parts
       for name, x in part.data.items()}, score,
      {f'{prefix}.{name}': roles for prefix, part in parts
       for name, roles in part.axes}, name=f'{first.name} and {then.name}')


def mask_at(mask, q_index, k_index) -> Array:
  """The mask (an array broadcastable to [B, N, T, S] or a SegmentMask) at
  pairs (q_index, k_index): [B?, N?, *I]; a broadcast axis reads index 0."""
  if isinstance(mask, (SegmentMask, PatternMask)):
    return mask.at(q_index, k_index)
  return pairs(mask, q_index, k_index)


def scored(logits_BxNxI: Array, bias, q_index, k_index) -> Array:
  """float32 logits [B, N, *I] of pairs (q_index, k_index) (int arrays
  broadcasting to I) under `bias`: plus a bias array (broadcastable to
  [B, N, T, S]; a broadcast axis reads index 0) at those pairs, or through
  a PositionBias's score function; unchanged for None."""
  logits_BxNxI = logits_BxNxI.astype(jnp.float32)
  if bias is None:
    return logits_BxNxI
  if isinstance(bias, PositionBias):
    return bias.apply(logits_BxNxI, q_index, k_index)
  return logits_BxNxI + pairs(bias, q_index, k_index).astype(jnp.float32)


def pairs(x: Array, q_index, k_index) -> Array:
  """x [B?, N?, T?, S?] at pairs (q_index, k_index): [B?, N?, *I]; a
  broadcast axis of x reads its index 0."""
  rows = q_index if x.shape[2] != 1 else np.zeros_like(q_index)
  cols = k_index if x.shape[3] != 1 else np.zeros_like(k_index)
  return x[:, :, rows, cols]


def _checked(assertion: Callable[..., None], *args, message: str,
             **kwargs) -> None:
  """A chex assertion, checked on shapes and dtypes as the function is
  traced (nothing is added to the program), failing as a ValueError that
  says what chex found, then `message`."""
  assertion(*args, **kwargs, custom_message=message,
            exception_type=ValueError)


def _check_rank4(name: str, x: Array, full_shape: tuple[int, ...]) -> None:
  """Checks that `x` broadcasts to [B, N, T, S] = `full_shape` dim by dim."""
  message = (f'{name} has shape {x.shape}; it must be rank 4 and '
             f'broadcastable to [B, N, T, S] = {full_shape}.')
  _checked(chex.assert_rank, x, 4, message=message)
  _checked(chex.assert_is_broadcastable, x.shape, full_shape,
           message=message)


def check_inputs(query, key, value, bias, mask) -> tuple[int, ...]:
  """Checks the inputs' ranks, shapes and the mask's dtype (chex, at trace
  time); returns the logits shape [B, N, T, S]. ValueError naming the
  argument and its shape."""
  for name, x in (('query', query), ('key', key), ('value', value)):
    _checked(chex.assert_rank, x, 4,
             message=f'{name} has shape {x.shape}; expected rank 4 [batch, '
             'length, heads, head_dim].')
  _checked(chex.assert_equal_shape, [key, value],
           message=f'key shape {key.shape} and value shape {value.shape} '
           'must be equal [B, S, K, H].')
  _checked(chex.assert_equal_shape, [query, key], dims=(0, 3),
           message=f'query shape {query.shape} [B, T, N, H] and key shape '
           f'{key.shape} [B, S, K, H] must agree in batch B and head dim H.')
  batch, q_len, num_heads, _ = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  if num_heads % num_kv_heads:  # No chex assertion says "divides".
    raise ValueError(
        f'key/value heads K={num_kv_heads} (key shape {key.shape}) must divide '
        f'query heads N={num_heads} (query shape {query.shape}).')
  full_shape = (batch, num_heads, q_len, kv_len)
  if isinstance(mask, PatternMask):
    mask = mask.mask
  if isinstance(mask, SegmentMask):
    _checked(chex.assert_shape, [mask.q_segment_ids_BxT, mask.kv_ids],
             [(batch, q_len), (batch, kv_len)],
             message=f'segment ids have shapes {mask.q_segment_ids_BxT.shape} '
             f'and {mask.kv_ids.shape}; expected [B, T] = {(batch, q_len)} '
             f'and [B, S] = {(batch, kv_len)}.')
  elif mask is not None:
    _check_rank4('mask', mask, full_shape)
    _checked(chex.assert_type, mask, bool,
             message=f'mask must be boolean (True = attend), got {mask.dtype}.')
  if isinstance(bias, PositionBias):
    bias.check()
  elif bias is not None:
    _check_rank4('bias', bias, full_shape)
  return full_shape


def check_self_key_padding(name: str, query: Array, key: Array,
                           mask) -> None:
  """ValueError unless `name` attention is self-attention (query and key
  lengths equal) under a key padding mask [B, 1, 1, S] or none: what a
  variant that builds its own keys from the row's positions honours."""
  if query.shape[1] != key.shape[1]:
    raise ValueError(
        f'{name} attention is self-attention: query length {query.shape[1]} '
        f'must equal key length {key.shape[1]}.')
  if mask is not None and (isinstance(mask, SegmentMask)
                           or mask.shape[1] != 1 or mask.shape[2] != 1):
    raise ValueError(
        f'{name} attention honours key padding masks only (shape '
        f'[B, 1, 1, S]), not a mask of shape {getattr(mask, "shape", mask)}.')


def causal_mask(q_len: int, kv_len: int) -> Array:
  """[T, S] bool, aligned bottom-right: query i sees keys j <= i + (S - T).

  With T < S the queries are the last T positions of the key sequence, which
  is what decoding with a cache of S - T earlier positions needs.
  """
  offset = kv_len - q_len
  return jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + offset


@jax.custom_jvp
def softmax_or_zero(logits: Array) -> Array:
  """Softmax over the last axis where -inf marks excluded entries; a row
  with every entry excluded is all zeros instead of NaN."""
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  unnormalized = jnp.exp(logits - row_max)
  total = jnp.sum(unnormalized, axis=-1, keepdims=True)
  return unnormalized / jnp.where(total > 0, total, 1.0)


@softmax_or_zero.defjvp
def _softmax_or_zero_jvp(primals, tangents):
  # The softmax derivative p * (dx - <p, dx>): one fused pass, and exactly
  # zero at excluded entries (p = 0) and in rows with nothing to attend.
  probs = softmax_or_zero(primals[0])
  tangent = tangents[0]
  return probs, probs * (tangent - jnp.sum(probs * tangent, axis=-1,
                                           keepdims=True))


def check_sinks(sinks: Array | None, num_heads: int) -> None:
  """ValueError unless `sinks` is None or one logit per query head [N]."""
  if sinks is not None and jnp.shape(sinks) != (num_heads,):
    raise ValueError(f'sinks has shape {jnp.shape(sinks)}; expected one '
                     f'logit per query head, [N] = ({num_heads},).')


def sink_softmax(logits_BxNxTxS: Array, sinks_N: Array | None) -> Array:
  """softmax_or_zero over the last axis of logits [B, N, ..., S] (-inf:
  excluded) with, where `sinks_N` is given, each head's sink logit as one
  more entry (of value zero, so dropped from the weights): attention
  sinks (Xiao et al. 2024; GPT-OSS's learned logit per head), which let a
  row put weight on nothing. Its gradient reaches the sinks."""
  if sinks_N is None:
    return softmax_or_zero(logits_BxNxTxS)
  column = jnp.broadcast_to(
      jnp.reshape(sinks_N.astype(jnp.float32),
                  (1, -1) + (1,) * (logits_BxNxTxS.ndim - 2)),
      logits_BxNxTxS.shape[:-1] + (1,))
  return softmax_or_zero(jnp.concatenate(
      [logits_BxNxTxS.astype(jnp.float32), column], axis=-1))[..., :-1]


def weights_from_logits(logits_BxNxTxS: Array, bias: Array | None,
                        mask: Array | None, is_causal: bool,
                        sinks: Array | None = None) -> Array:
  """Adds the bias, applies the mask and causality, and takes the softmax
  (with `sinks` [N], see sink_softmax): float32 [B, N, T, S], rows of
  zeros where nothing may be attended. Masked logits become -inf (not a
  large finite number, whose gradient would leak through `where`)."""
  every_pair = (np.arange(logits_BxNxTxS.shape[-2])[:, None],
                np.arange(logits_BxNxTxS.shape[-1])[None, :])
  if isinstance(mask, (SegmentMask, PatternMask)):
    mask = mask.at(*every_pair)
  logits_BxNxTxS = scored(logits_BxNxTxS, bias, *every_pair)
  if is_causal:
    causal = causal_mask(*logits_BxNxTxS.shape[-2:])
    mask = causal if mask is None else jnp.logical_and(mask, causal)
  if mask is not None:
    logits_BxNxTxS = jnp.where(mask, logits_BxNxTxS, -jnp.inf)
  return sink_softmax(logits_BxNxTxS, sinks)


def weighted_values(weights_BxNxTxS: Array, value: Array, dtype) -> Array:
  """sum_s weights[b, n, t, s] value[b, s, n // G, :]: [B, T, N, H] in dtype.

  Weights meet the values in the values' dtype, accumulated in float32.
  """
  batch, num_heads, q_len, kv_len = weights_BxNxTxS.shape
  num_kv_heads, head_dim = value.shape[2], value.shape[3]
  group = num_heads // num_kv_heads
  # One matmul per (example, key head) over its G * T rows (see _weights).
  weights = weights_BxNxTxS.reshape(batch, num_kv_heads, group * q_len,
                                    kv_len)
  out_BxGTxKxH = jnp.einsum('bkrs,bskh->brkh', weights.astype(value.dtype),
                            value, preferred_element_type=jnp.float32)
  out = out_BxGTxKxH.reshape(batch, group, q_len, num_kv_heads, head_dim)
  return jnp.transpose(out, (0, 2, 3, 1, 4)).reshape(
      batch, q_len, num_heads, head_dim).astype(dtype)


def softcap(logits: Array, cap: float) -> Array:
  """cap * tanh(logits / cap): logits bounded by +-cap, unchanged near 0
  (Gemma 2; the modded-nanogpt records); `logits` themselves where cap is
  0."""
  return cap * jnp.tanh(logits / cap) if cap else logits


def check_logit_cap(logit_cap: float) -> None:
  if isinstance(logit_cap, bool) or not (
      math.isfinite(logit_cap) and logit_cap >= 0):
    raise ValueError(f'logit_cap={logit_cap} must be a finite number >= 0 '
                     '(0: no cap).')


def _weights(query, key, bias, mask, scale, is_causal, logit_cap,
             sinks=None) -> Array:
  """`attention_weights` without the input checks."""
  batch, q_len, num_heads, head_dim = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  if scale is None:
    scale = 1.0 / math.sqrt(head_dim)
  # Grouped heads: query head k * G + g reads key/value head k. The G * T
  # query rows of a key head meet its keys in one plain matmul, rows in
  # (g, t) order so that [B, K, G * T, S] is [B, N, T, S] reshaped (on CPU
  # about 2.7x faster than a 'btkgh,bskh->bkgts' einsum with its softmax).
  group = num_heads // num_kv_heads
  q_BxGTxKxH = jnp.transpose(
      query.reshape(batch, q_len, num_kv_heads, group, head_dim),
      (0, 3, 1, 2, 4)).reshape(batch, group * q_len, num_kv_heads, head_dim)
  logits_BxKxGTxS = jnp.einsum('brkh,bskh->bkrs', q_BxGTxKxH, key,
                               preferred_element_type=jnp.float32)
  logits_BxNxTxS = softcap(logits_BxKxGTxS.reshape(
      batch, num_heads, q_len, kv_len) * scale, logit_cap)
  return weights_from_logits(logits_BxNxTxS, bias, mask, is_causal, sinks)


def attention_weights(query: Array, key: Array, bias: Array | None = None,
                      mask: Array | None = None, *, scale: float | None = None,
                      is_causal: bool = False, logit_cap: float = 0.0,
                      sinks: Array | None = None) -> Array:
  """Attention probabilities, float32 [B, N, T, S].

  Each row sums to 1 over the keys it may attend (less what its sink
  takes), or is all zeros when it may attend none. Arguments as in
  `scaled_dot_product_attention`.
  """
  check_inputs(query, key, key, bias, mask)
  check_logit_cap(logit_cap)
  check_sinks(sinks, query.shape[2])
  return _weights(query, key, bias, mask, scale, is_causal, logit_cap, sinks)


def _dropout(weights: Array, rate: float, rng: Array) -> Array:
  keep = jax.random.bernoulli(rng, 1.0 - rate, weights.shape)
  return jnp.where(keep, weights / (1.0 - rate), 0.0)


def scaled_dot_product_attention(
    query: Array, key: Array, value: Array, bias: Array | None = None,
    mask: Array | None = None, *, scale: float | None = None,
    is_causal: bool = False, dropout_rate: float = 0.0,
    dropout_rng: Array | None = None, logit_cap: float = 0.0,
    sinks: Array | None = None) -> Array:
  """softmax(q k^T * scale + bias, masked) v (Vaswani et al. 2017), [B, T, N, H].

  Args:
    query: [B, T, N, H].
    key: [B, S, K, H], K dividing N.
    value: [B, S, K, H].
    bias: added to the logits, broadcastable to [B, N, T, S].
    mask: bool, True = attend, broadcastable to [B, N, T, S].
    scale: logit scale; default 1 / sqrt(H).
    is_causal: query i attends keys j <= i + (S - T) (see `causal_mask`).
    dropout_rate: dropout on the attention weights, applied only when
      `dropout_rng` is given.
    dropout_rng: PRNG key for dropout.
    logit_cap: softcap(q k^T * scale, logit_cap) before the bias and the
      mask (Gemma 2's attention logits); 0 for none. What the bias adds
      (ALiBi's, T5's, the relative schemes' position terms) is not capped.
    sinks: float32 [N], a logit per query head in each row's normaliser
      (`sink_softmax`); None for none.
  """
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f'dropout_rate={dropout_rate} must be in [0, 1).')
  check_inputs(query, key, value, bias, mask)
  check_logit_cap(logit_cap)
  check_sinks(sinks, query.shape[2])
  weights_BxNxTxS = _weights(query, key, bias, mask, scale, is_causal,
                             logit_cap, sinks)
  if dropout_rate > 0.0 and dropout_rng is not None:
    weights_BxNxTxS = _dropout(weights_BxNxTxS, dropout_rate, dropout_rng)
  return weighted_values(weights_BxNxTxS, value, query.dtype)


def causal_attention(query: Array, key: Array, value: Array, **kwargs) -> Array:
  """`scaled_dot_product_attention` with `is_causal=True`."""
  return scaled_dot_product_attention(query, key, value, is_causal=True,
                                      **kwargs)


def cross_attention(query: Array, key: Array, value: Array, *,
                    key_padding_mask: Array | None = None, **kwargs) -> Array:
  """Queries of one sequence attend to keys/values of another.

  Args:
    key_padding_mask: [B, S] bool, True at real (non-padding) keys; combined
      with any `mask` given in kwargs.
  """
  if key_padding_mask is not None:
    batch, kv_len = key.shape[0], key.shape[1]
    if key_padding_mask.shape != (batch, kv_len):
      raise ValueError(
          f'key_padding_mask has shape {key_padding_mask.shape}; expected '
          f'[B, S] = {(batch, kv_len)}.')
    padding = key_padding_mask.astype(jnp.bool_)[:, None, None, :]
    mask = kwargs.pop('mask', None)
    kwargs['mask'] = padding if mask is None else jnp.logical_and(mask, padding)
  return scaled_dot_product_attention(query, key, value, **kwargs)
