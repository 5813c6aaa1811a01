"""Builder configs named after their values, for the generated datasets."""

import dataclasses

import tensorflow_datasets as tfds

_INHERITED = frozenset(field.name for field in dataclasses.fields(
    tfds.core.BuilderConfig))


def options_of(config_cls) -> dict[str, type]:
  """The fields a config class adds to tfds.core.BuilderConfig, by name,
  with their types."""
  return {field.name: field.type for field in dataclasses.fields(config_cls)
          if field.name not in _INHERITED}


def named(config_cls, **values) -> tfds.core.BuilderConfig:
  """`config_cls(**values)` named after all its option values, so that each
  distinct choice is built once and found again in the data_dir."""
  draft = config_cls(name='draft', **values)
  name = '_'.join(f'{option}-{getattr(draft, option)}'
                  for option in options_of(config_cls))
  return config_cls(name=name, **values)


def check_integers(config, minimums: dict[str, int]) -> None:
  """ValueError naming the first of `config`'s fields in `minimums` that is
  not an integer at least its minimum (the generated datasets' own check
  of their sizes, lengths and seeds)."""
  for name, minimum in minimums.items():
    value = getattr(config, name)
    if not isinstance(value, int) or value < minimum:
      raise ValueError(f'{name}={value!r} must be an integer >= {minimum}.')
