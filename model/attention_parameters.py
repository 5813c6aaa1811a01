"""Parameters that some attention variants own, created by MultiHeadAttention.

A variant named here gets its parameters from a function called inside
`MultiHeadAttention`'s scope with (module, config, **options); it takes the
options that shape the parameters as keyword arguments and returns the
keyword arguments of the variant's pure function: the parameters and the
other options. Adding such a variant needs an entry here and in the
registry, and no change to the model.
"""

from collections.abc import Callable
import inspect
import math
import typing
from typing import Any

import flax.linen as nn

from model import attention
from model.config import ModelConfig

# Keyword arguments MultiHeadAttention sets itself, never options.
_SET_BY_THE_MODEL = frozenset({'is_causal', 'dropout_rate', 'dropout_rng'})


def _linformer(module: nn.Module, config: ModelConfig, *, rank: int = 64,
               **options) -> dict[str, Any]:
  """E and F [rank, max_len], Gaussian with variance 1 / rank."""
  init = nn.with_logical_partitioning(
      nn.initializers.normal(stddev=rank ** -0.5), (None, 'length'))
  return options | {
      'key_projection': module.param('linformer_key', init,
                                     (rank, config.max_len),
                                     config.weight_dtype),
      'value_projection': module.param('linformer_value', init,
                                       (rank, config.max_len),
                                       config.weight_dtype)}


def _additive(module: nn.Module, config: ModelConfig, *,
              hidden: int | None = None, **options) -> dict[str, Any]:
  """W_q, W_k [N, H, A] and v [N, A]; A = `hidden` (default H)."""
  hidden = config.head_dim if hidden is None else hidden
  heads, head_dim = config.num_heads, config.head_dim
  matrix = nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                        ('heads', 'kv', None))
  vector = nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                        ('heads', None))
  return options | {
      'query_weight': module.param('additive_query', matrix,
                                   (heads, head_dim, hidden),
                                   config.weight_dtype),
      'key_weight': module.param('additive_key', matrix,
                                 (heads, head_dim, hidden),
                                 config.weight_dtype),
      'score_weight': module.param('additive_score', vector, (heads, hidden),
                                   config.weight_dtype)}


def _memory_compressed(module: nn.Module, config: ModelConfig, *,
                       width: int = 3, **options) -> dict[str, Any]:
  """The keys' and values' convolutions [width, K, H, K, H], Xavier over
  (width * K * H inputs, K * H outputs)."""
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


PARAMETERS: dict[str, Callable[..., dict[str, Any]]] = {
    'linformer': _linformer,
    'additive': _additive,
    'memory_compressed': _memory_compressed,
}
def _keyword_options(fn: Callable[..., Any]) -> dict[str, type]:
  """{name: type} of `fn`'s keyword-only arguments that have defaults, the
  type as annotated (`int | None` read as int)."""
  hints = typing.get_type_hints(fn)
  options = {}
  for p in inspect.signature(fn).parameters.values():
    if p.kind == p.KEYWORD_ONLY and p.default is not p.empty:
      kinds = [kind for kind in typing.get_args(hints[p.name])
               if kind is not type(None)]
      options[p.name] = kinds[0] if kinds else hints[p.name]
  return options


def option_types(name: str) -> dict[str, type]:
  """{key: type} of the keys of config.model.attention_options that
  attention `name` takes: its function's keyword options and those its
  parameters read."""
  taken = {option: kind
           for option, kind in _keyword_options(attention.get(name)).items()
           if option not in _SET_BY_THE_MODEL}
  if name in PARAMETERS:
    taken |= _keyword_options(PARAMETERS[name])
  return taken


def option_names(name: str) -> set[str]:
  """The keys of config.model.attention_options that attention `name`
  takes."""
  return set(option_types(name))


def takes_kernel(name: str) -> bool:
  """Whether attention `name` takes a fused kernel (the option `kernel`)."""
  return name in attention.names() and 'kernel' in option_names(name)


def variant_kwargs(module: nn.Module, config: ModelConfig) -> dict[str, Any]:
  """The keyword arguments of `config.attention` for this module: its
  options, with any parameters it owns created and passed in."""
  options = dict(config.attention_options)
  if config.attention in PARAMETERS:
    return PARAMETERS[config.attention](module, config, **options)
  return options
