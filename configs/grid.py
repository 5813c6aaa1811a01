"""Helpers for a config's `get_sweep()`: lists of override dicts.

  def get_sweep():
    return grid.product(learning_rate=[5e-4, 1e-3, 2e-3],
                        warmup_steps=[100, 200])

Keys are config keys, dotted for nested ones ('model.d_model'); pass them
with ** when they have dots: grid.product(**{'model.d_model': [64, 128]}).
"""

import itertools
from typing import Any


def product(**values: list[Any]) -> list[dict[str, Any]]:
  """Every combination: product(a=[1, 2], b=[3, 4]) gives 4 trials."""
  keys = list(values)
  return [dict(zip(keys, combination))
          for combination in itertools.product(*values.values())]


def zipped(**values: list[Any]) -> list[dict[str, Any]]:
  """Values taken together: zipped(a=[1, 2], b=[3, 4]) gives
  [{a: 1, b: 3}, {a: 2, b: 4}]; the lists must be equally long."""
  lengths = {len(v) for v in values.values()}
  if len(lengths) > 1:
    raise ValueError(f'zipped() needs lists of one length, got '
                     f'{ {k: len(v) for k, v in values.items()} }.')
  keys = list(values)
  return [dict(zip(keys, combination)) for combination in zip(*values.values())]
