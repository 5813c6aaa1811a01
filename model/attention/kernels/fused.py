"""Fused attention kernels, and which one computes a case.

`chunked`, the block-sparse variants for their patterns (`local`,
`strided`, `fixed`, `bigbird`; `moba` for the blocks its data chose),
and the variants given by their functions (flex_variant.py) compute exact
attention with one of:

  xla         the JAX code of chunked.py (the block-sparse variants: their
              gathered parts in sparse.py; moba's in moba.py); every case,
              on every backend.
  cudnn       cuDNN's fused attention, `jax.nn.dot_product_attention(
              implementation='cudnn')`; GPU. Packed rows go in as its
              packed layout (cudnn_packed.py), on Hopper and newer; local's
              window as its sliding window.
  pallas_tpu  Pallas splash attention (`jax.experimental.pallas.ops.tpu.
              splash_attention`), a block-sparse pattern as its block mask;
              under a score function (a position bias, a cap on the
              logits) or moba's blocks the project's general kernel
              (flex_tpu.py); TPU, and the CPU in interpret mode.
  pallas_gpu  Pallas flash attention (`jax.experimental.pallas.ops.gpu.
              attention.mha`); under a score function, a cap, a window, a
              block-sparse pattern or key padding the project's general
              kernel (flex_gpu.py); GPU, and the CPU in interpret mode.

A kernel takes a case only where it computes it as `dense` does;
`refusal(kernel, case)` says why it does not. `kernel='auto'` takes the
first kernel of AUTO_ORDER[backend] that computes the case, else xla; it
leaves to xla the patterns whose sparsity is not in tiles (strided's and
fixed's columns reach nearly every tile, so a kernel would do about dense
attention's work: name a kernel to run them there). A
kernel named explicitly that cannot compute the case raises KernelError:
nothing falls back silently. A `Case` holds only what shapes and types say,
so the choice is made while tracing; `recording()` collects the choices of
a trace, which is how a config's choices are known before anything is
compiled (train/config/kernels.py).

Under a mesh every fused kernel runs in a `shard_map` that splits the batch
and the heads as the model's own arrays are split, read from the same
logical axis rules (fused_kernels.over_shards): under the trainer's rules
nothing is gathered and no work repeated (rules that send query and
key/value heads to different mesh axes leave the heads whole on each
device). A length split over the mesh (sequence parallelism) is
refused by every fused kernel: the `ring` variant computes that layout.
"""

from collections.abc import Iterator
import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp

from model.attention import core
from model.attention.core import logical_axes, patterns
from model.attention.kernels import cudnn_packed, flex, fused_kernels

Array = jax.Array

KERNELS = ('auto', 'xla', 'cudnn', 'pallas_tpu', 'pallas_gpu')
# The fused kernels 'auto' tries on each backend, in this order; then xla.
AUTO_ORDER = {'tpu': ('pallas_tpu',), 'gpu': ('cudnn', 'pallas_gpu')}


class KernelError(ValueError):
  """A kernel named explicitly cannot compute the case at hand."""


@dataclasses.dataclass(frozen=True)
class Case:
  """What an attention call asks of a kernel, as its shapes and types say.

  mask: 'none'; 'segments' (a SegmentMask of self-attention: one id array
    for queries and keys); 'key_padding' (a bool array [B, 1, 1, S]);
    'other' (any other mask).
  bias: 'none', 'array' or 'function' (a PositionBias: a score function).
  score_name: the score function's name (PositionBias.name).
  score_refusal: why the general kernels (flex.py) cannot compute the
    score function (flex.refusal); None where they can.
  window: local attention's window (query i sees keys j with |i - j| <
    window; causal: 0 <= i - j < window); None for none.
  length_shards: the devices the mesh splits the length over.
  compute_capability: a CUDA GPU's, e.g. '9.0'; None elsewhere.
  max_segments: under packed rows, the most runs of one id a row holds
    (SegmentMask.max_segments), where the data bounds it.
  pattern: a block-sparse variant's pattern (patterns.py: Strided, Fixed,
    BigBird, Moba); None for none.
  logit_cap: a tanh cap on the scores (core.softcap), which the general
    kernels compute; 0 for none.
  sinks: a learned logit per head in each row's normaliser
    (core.sink_softmax), which the general kernels compute.
  """

  backend: str
  dtype: str
  head_dim: int
  q_len: int
  kv_len: int
  is_causal: bool
  mask: str = 'none'
  bias: str = 'none'
  window: int | None = None
  length_shards: int = 1
  compute_capability: str | None = None
  max_segments: int | None = None
  pattern: patterns.Pattern | None = None
  logit_cap: float = 0.0
  score_name: str | None = None
  score_refusal: str | None = None
  sinks: bool = False

  @property
  def seen(self) -> patterns.Pattern | None:
    """The pattern of the pairs it sees: its block-sparse pattern, or
    local's window as one; None for every pair."""
    return self.pattern or (patterns.Window(self.window) if self.window
                            else None)

  def describe(self) -> str:
    """e.g. 'bfloat16, causal, packed rows'."""
    parts = [self.dtype, 'causal' if self.is_causal else 'bidirectional']
    parts += {'segments': ['packed rows'], 'key_padding': ['padded rows'],
              'other': ['a mask array'], 'none': []}[self.mask]
    parts += {'array': ['a bias array'],
              'function': [self.score_name or 'a score function'],
              'none': []}[self.bias]
    if self.window:
      parts.append(f'window {self.window}')
    if self.pattern:
      parts.append(f"{pattern_name(self.pattern)}'s pattern")
    if self.length_shards > 1:
      parts.append(f'length split over {self.length_shards} devices')
    if self.logit_cap:
      parts.append(f'logits capped at {self.logit_cap:g}')
    if self.sinks:
      parts.append('attention sinks')
    return ', '.join(parts)


def pattern_name(pattern: patterns.Pattern) -> str:
  """e.g. 'bigbird'."""
  return type(pattern).__name__.lower()


def _mask_kind(mask) -> str:
  """`Case.mask` of a mask argument."""
  if mask is None:
    return 'none'
  if isinstance(mask, core.PatternMask):
    return 'other'
  if isinstance(mask, core.SegmentMask):
    return 'segments' if mask.kv_segment_ids_BxS is None else 'other'
  return 'key_padding' if mask.shape[1:3] == (1, 1) else 'other'


def device_description() -> tuple[str, str | None]:
  """(the default backend, its first device's CUDA compute capability or
  None): what a Case reads of the hardware."""
  backend = jax.default_backend()
  capability = (getattr(jax.devices()[0], 'compute_capability', None)
                if backend == 'gpu' else None)
  return backend, capability


def case_of(query: Array, key: Array, bias, mask, *, is_causal: bool,
            window: int | None = None,
            pattern: patterns.Pattern | None = None,
            logit_cap: float = 0.0, sinks=None) -> Case:
  """The Case of a call on the default backend (`sinks`: its sink logits
  or None)."""
  score = isinstance(bias, core.PositionBias)
  bias_kind = 'none' if bias is None else 'function' if score else 'array'

  dtype = jnp.dtype(query.dtype).name
  if key.dtype != query.dtype:  # The fused kernels take one dtype.
    dtype += f' queries, {jnp.dtype(key.dtype).name} keys'
  length_axes = fused_kernels.split_axes(logical_axes.LENGTH)
  backend, capability = device_description()
  return Case(backend, dtype, query.shape[-1], query.shape[1], key.shape[1],
              is_causal, _mask_kind(mask), bias_kind, window,
              math.prod(jax.sharding.get_abstract_mesh().shape[axis]
                        for axis in length_axes), capability,
              getattr(mask, 'max_segments', None), pattern, logit_cap,
              bias.name if score else None,
              flex.refusal(bias) if score else None, sinks is not None)


def _cudnn_refusal(case: Case) -> str | None:
  if case.backend != 'gpu':
    return 'needs a GPU'
  if case.dtype not in ('bfloat16', 'float16'):
    return f'takes bfloat16 or float16 inputs, not {case.dtype}'
  if case.head_dim > 128 or case.head_dim % 8:
    return (f'takes head dims that are multiples of 8 up to 128, not '
            f'{case.head_dim}')
  if case.is_causal and case.q_len != case.kv_len:
    return ('aligns the causal diagonal top-left, and dense bottom-right, '
            'when queries and keys differ in number')
  if case.pattern:
    return 'takes no block-sparse pattern (a sliding window only)'
  if case.sinks:
    return ('computes no attention sinks (a logit per head in the '
            'normaliser: config.model.attention_sinks)')
  if case.mask == 'segments':
    return _cudnn_packed_refusal(case)
  if case.mask == 'other':
    return 'takes no mask but right padding (a row it masks whole differs)'
  if case.bias == 'function':
    return 'takes a bias array, not a score function'
  if case.logit_cap:
    return 'computes no cap on the attention logits (logit_cap)'
  if case.window and not case.is_causal:
    return 'takes a window only under a causal mask'
  if case.window and case.mask == 'key_padding':
    return 'may leave a padded query no key in its window'
  return None


def _cudnn_packed_refusal(case: Case) -> str | None:
  """Packed rows, through cuDNN's packed layout (cudnn_packed.py)."""
  try:
    capability = tuple(int(part) for part in
                       (case.compute_capability or '0').split('.'))
  except ValueError:  # Not a CUDA device's.
    capability = ()
  if capability < (9, 0):
    return ('takes packed rows on Hopper or newer GPUs only (compute '
            f'capability 9.0 or more; this one: '
            f'{case.compute_capability or "unknown"})')
  if case.max_segments is None:
    return ('takes packed rows only where the data bounds the segments of '
            'a row (config.model.max_segments_per_row)')
  if case.bias != 'none' or case.window:
    return 'takes packed rows without a bias or a window'
  return cudnn_packed.refusal()


def _pallas_tpu_refusal(case: Case) -> str | None:
  if case.backend not in ('tpu', 'cpu'):
    return 'needs a TPU (or the CPU, interpreted)'
  if case.dtype not in ('float32', 'bfloat16'):
    return f'takes float32 or bfloat16 inputs, not {case.dtype}'
  if case.is_causal and case.q_len != case.kv_len:
    return 'is causal only with as many queries as keys'
  if case.mask == 'other':
    return 'takes segment ids or a key padding mask, not a mask array'
  if case.bias != 'none' or case.logit_cap or case.sinks or isinstance(
      case.pattern, patterns.Moba) or (
          case.mask == 'key_padding' and case.pattern is not None
          and not hasattr(case.pattern, 'sees_keys')):
    return _general_refusal(case, tiles=(128,))  # The general kernel's.
  return None


def _pallas_gpu_refusal(case: Case) -> str | None:
  if case.backend not in ('gpu', 'cpu'):
    return 'needs a GPU (or the CPU, interpreted)'
  if case.dtype not in ('float32', 'bfloat16', 'float16'):
    return f'takes float32, bfloat16 or float16 inputs, not {case.dtype}'
  if case.q_len != case.kv_len:
    return ('computes self-attention only (one array of segment ids serves '
            'queries and keys)')
  if case.mask == 'other':
    return 'takes segment ids or a key padding mask, not a mask array'
  if case.head_dim > 128:
    return f'takes head dims up to 128, not {case.head_dim}'
  if (case.bias != 'none' or case.logit_cap or case.sinks or case.window
      or case.pattern or case.mask == 'key_padding'):  # The general kernel's.
    return _general_refusal(case, tiles=(16, 32, 64, 128))
  return None


def _general_refusal(case: Case, tiles: tuple[int, ...]) -> str | None:
  """The general kernel's (flex_gpu.py, flex_tpu.py), whose tiles are
  `tiles` long."""
  if case.bias == 'array':
    return ('takes no bias array (a score function instead: '
            'core.PositionBias)')
  if case.score_refusal:
    return case.score_refusal
  if case.q_len != case.kv_len:
    return ('computes self-attention only under a score function, sinks, '
            'a window, a block-sparse pattern or key padding')
  if case.head_dim not in (16, 32, 64, 128):
    return (f'takes head dims of 16, 32, 64 or 128 in its general kernel, '
            f'not {case.head_dim}')
  tile = getattr(case.pattern, 'tile', None)
  if tile is not None and not (tile in tiles or tile % max(tiles) == 0):
    return (f"takes {pattern_name(case.pattern)}'s block as its tile: "
            f"{', '.join(map(str, tiles))} or a multiple of {max(tiles)}, "
            f'not {tile}')
  return None


_REFUSALS = {'xla': lambda case: None, 'cudnn': _cudnn_refusal,
             'pallas_tpu': _pallas_tpu_refusal,
             'pallas_gpu': _pallas_gpu_refusal}


def refusal(kernel: str, case: Case) -> str | None:
  """Why `kernel` does not compute `case` as dense does; None if it does."""
  if kernel != 'xla' and case.length_shards > 1:
    return (f'cannot split the length over {case.length_shards} devices '
            "(sequence parallelism; the 'ring' attention computes that)")
  return _REFUSALS[kernel](case)


@dataclasses.dataclass(frozen=True)
class Decision:
  """One call's choice, as `recording()` keeps it."""

  # Where the call came from (`caller`): the attention module's path in
  # the model, e.g. ('decoder', 'block_0', 'self_attention'); () unsaid.
  caller: tuple[str, ...]
  option: str  # The kernel asked for ('auto' or one of KERNELS).
  case: Case
  # What computes the case; None where `option` cannot (`refusal`).
  kernel: str | None
  refusal: str | None


# The Decisions of the innermost `recording()`, and the current caller.
_RECORD = contextvars.ContextVar('fused_record', default=None)
_CALLER = contextvars.ContextVar('fused_caller', default=())


@contextlib.contextmanager
def recording() -> Iterator[list[Decision]]:
  """Collects the Decision of every `choose` called within, in order.

  Within, no kernel that cannot compute its case raises (the refusal is in
  its Decision; a name that is not one of KERNELS still does), and
  `choose` answers 'xla' whatever it decided: a trace inside computes
  the same shapes as the chosen kernels would, on any backend, so a model
  can be traced for its choices before they are run.
  """
  decisions = []
  token = _RECORD.set(decisions)
  try:
    yield decisions
  finally:
    _RECORD.reset(token)


@contextlib.contextmanager
def caller(path: tuple[str, ...]) -> Iterator[None]:
  """`choose` calls within come from `path` (a module's path)."""
  token = _CALLER.set(tuple(path))
  try:
    yield
  finally:
    _CALLER.reset(token)


def choose(kernel: str, case: Case) -> str:
  """The kernel that computes `case`: `kernel` itself, or for 'auto' the
  first of AUTO_ORDER[case.backend] that can, else 'xla'. Within
  `recording()`, the decision is recorded and 'xla' returned.

  Raises:
    ValueError: `kernel` is not one of KERNELS.
    KernelError: `kernel` was named and cannot compute the case.
  """
  if kernel not in KERNELS:
    raise ValueError(f'kernel={kernel!r} must be one of {list(KERNELS)}.')
  reason = None
  if kernel == 'auto':
    chosen = next((name for name in AUTO_ORDER.get(case.backend, ())
                   if refusal(name, case) is None
                   and getattr(case.pattern, 'in_tiles', True)), 'xla')
  else:
    reason = refusal(kernel, case)
    chosen = kernel if reason is None else None
  record = _RECORD.get()
  if record is not None:
    record.append(Decision(_CALLER.get(), kernel, case, chosen, reason))
    return 'xla'
  if reason is not None:
    raise KernelError(f'kernel={kernel!r} {reason} ({case.describe()} on '
                      f'{case.backend}).')
  return chosen


def run(kernel: str, query: Array, key: Array, value: Array, bias, mask, *,
        scale: float, is_causal: bool, window: int | None = None,
        pattern: patterns.Pattern | None = None,
        logit_cap: float = 0.0, sinks: Array | None = None,
        routing: Array | None = None) -> Array:
  """Attention [B, T, N, H] by fused `kernel` (as `choose` returned it),
  under local's `window` or a block-sparse `pattern` (patterns.py; under
  moba's, its `routing` [B, N, T, k], the blocks each query chose), the
  scores capped by `logit_cap` (core.softcap), with `sinks` [N] (or
  None) in the normaliser."""
  fn = {'cudnn': fused_kernels.cudnn_attention,
        'pallas_tpu': fused_kernels.splash,
        'pallas_gpu': fused_kernels.pallas_gpu}[kernel]
  return fused_kernels.over_shards(
      lambda q, k, v, b, m, sinks, routing: fn(
          q, k, v, b, m, scale=scale, is_causal=is_causal, window=window,
          pattern=pattern, logit_cap=logit_cap, sinks=sinks,
          routing=routing),
      query, key, value, bias, mask, sinks, routing)
