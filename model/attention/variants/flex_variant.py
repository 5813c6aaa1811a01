"""A variant given by its functions (FlexAttention's score_mod and
mask_mod): a score function on the logits and a pattern of the pairs
seen, registered under a name with `attention.register(name,
flex_variant.variant(...))` and then run as any other: the exact XLA
code (chunked, the pattern evaluated by blocks), the general fused kernel
on a GPU and a TPU (flex.py) with gradients to its learned data, the
kernel table's `auto` choice, the configs' options, the benchmarks' rows.
"""

from collections.abc import Callable
import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp

from model.attention import core
from model.attention.variants import chunked

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Learned:
  """A learned entry of a score function's data: its axes ('head', one per
  query head; an int, a free axis of that many rows) and its initial value
  (a number, or a flax initializer)."""

  axes: tuple[str | int, ...]
  init: Any = 0.0

  def create(self, module, name: str, num_heads: int) -> Array:
    shape = tuple(num_heads if axis == 'head' else axis for axis in self.axes)
    init = self.init if callable(self.init) else (
        lambda _, shape, dtype: jnp.full(shape, self.init, dtype))
    return module.param(name, init, shape, jnp.float32)

  @property
  def roles(self) -> tuple[str | None, ...]:
    return tuple('head' if axis == 'head' else None for axis in self.axes)


def _options(pattern) -> list[inspect.Parameter]:
  """The pattern's fields with defaults, as keyword options."""
  if pattern is None:
    return []
  return [inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY,
                            default=p.default, annotation=p.annotation)
          for p in inspect.signature(pattern).parameters.values()
          if p.default is not p.empty]


def variant(*, name: str, pattern: Callable[..., Any] | None = None,
            score: Callable[..., Array] | None = None,
            learned: dict[str, Learned] | None = None):
  """The registry entry (attention.Variant) of the attention that applies
  `score(s, data, q_index, k_index, head)` (core.PositionBias's fn; data:
  the `learned` entries) to q.k * scale, then the model's position bias,
  over the pairs `pattern(**options).allowed` sees (a frozen dataclass of
  patterns.py's interface: its fields with defaults become the variant's
  options); self-attention where it has a pattern."""
  from model import attention  # The registry imports this module.
  learned = learned or {}
  pattern_options = _options(pattern)

  def attend(query, key, value, bias=None, mask=None, *, scale=None,
             is_causal=False, kernel='auto', chunk_size=None, data=None,
             sinks=None, **options):
    if options and pattern is None:
      raise TypeError(f'{name} takes no options {sorted(options)}.')
    if score:
      bias = core.chained(core.PositionBias(
          data or {}, score, {entry: spec.roles
                              for entry, spec in learned.items()},
          name=name), bias)
    return chunked.attend(query, key, value, bias, mask, scale=scale,
                          is_causal=is_causal, kernel=kernel,
                          chunk_size=chunk_size,
                          pattern=pattern(**options) if pattern else None,
                          sinks=sinks)

  keyword = inspect.Parameter.KEYWORD_ONLY
  attend.__signature__ = inspect.signature(attend).replace(parameters=[
      *list(inspect.signature(attend).parameters.values())[:5],
      inspect.Parameter('scale', keyword, default=None,
                        annotation=float | None),
      inspect.Parameter('is_causal', keyword, default=False, annotation=bool),
      inspect.Parameter('kernel', keyword, default='auto', annotation=str),
      inspect.Parameter('chunk_size', keyword, default=None,
                        annotation=int | None),
      *pattern_options,
      *([inspect.Parameter('data', keyword)] if learned else []),
      inspect.Parameter('sinks', keyword, default=None,
                        annotation=Array | None)])
  attend.__annotations__ = {
      p.name: p.annotation for p in attend.__signature__.parameters.values()
      if p.annotation is not p.empty}
  attend.__name__ = attend.__qualname__ = name

  def parameters(module, config, **options):
    return {'data': {entry: spec.create(module, entry, config.num_heads)
                     for entry, spec in learned.items()}, **options}

  return attention.Variant(
      attend, causal=True, masks='any', bias=True, dropout=False,
      self_only=pattern is not None,
      parameters=parameters if learned else None)
