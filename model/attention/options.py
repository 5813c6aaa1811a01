"""A variant's options (config.model.attention_options): which keys it
takes and of what type, read from the signatures of its function and of
the parameters it owns (Variant.parameters) or the projections it makes
(Variant.latent_projections), and its keyword arguments in a model, those
parameters created.
"""

from collections.abc import Callable
import inspect
import typing
from typing import Any

import flax.linen as nn

from model import attention

# Keyword arguments MultiHeadAttention sets itself, never options (state:
# a recurrence's, while decoding; convolution: the kernels its parameters
# make, of the option conv_width; sinks: its parameter of
# config.model.attention_sinks).
_SET_BY_THE_MODEL = frozenset({'is_causal', 'dropout_rate', 'dropout_rng',
                               'state', 'convolution', 'sinks'})


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
  variant = attention.spec(name)
  for maker in (variant.parameters, variant.latent_projections):
    if maker:
      taken |= _keyword_options(maker)
  return taken


def option_names(name: str) -> set[str]:
  """The keys of config.model.attention_options that attention `name`
  takes."""
  return set(option_types(name))


def option_key(model_config, given, name: str, option: str) -> str:
  """The config key of `option` of attention `name` in the form it was
  typed in `given` (config.model.attention_options as set): under the
  attention's name (attention_options.bigbird.kernel) where it was set
  there, else as `model_config` (a ModelConfig) reads it
  (ModelConfig.option_key)."""
  by_name = given.get(name) if hasattr(given, 'keys') else None
  if hasattr(by_name, 'keys') and by_name.get(option) is not None:
    return f'config.model.attention_options.{name}.{option}'
  return model_config.option_key(name, option)


def takes_kernel(name: str) -> bool:
  """Whether attention `name` takes a fused kernel (the option `kernel`)."""
  return name in attention.names() and 'kernel' in option_names(name)


def _projecting(config) -> set[str]:
  """The option names that shape the latent projections of
  `config.attention` (Variant.latent_projections; none without)."""
  maker = attention.spec(config.attention).latent_projections
  return set(_keyword_options(maker)) if maker else set()


def variant_kwargs(module: nn.Module, config) -> dict[str, Any]:
  """The keyword arguments of `config.attention` (config: a layer's
  ModelConfig) for the attention layer `module`: its options, with any
  parameters it owns created in `module` and passed in."""
  options = dict(config.attention_options)
  variant = attention.spec(config.attention)
  if variant.parameters:
    return variant.parameters(module, config, **options)
  projecting = _projecting(config)
  return {key: value for key, value in options.items()
          if key not in projecting}


def projection_options(config) -> dict[str, Any]:
  """The options of `config.attention` (config: a layer's ModelConfig)
  that shape its latent projections (Variant.latent_projections)."""
  projecting = _projecting(config)
  return {key: value for key, value in dict(config.attention_options).items()
          if key in projecting}
