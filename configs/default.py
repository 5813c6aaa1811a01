"""Defaults shared by every experiment config.

Each experiment's `get_config()` starts from `get_config()` here and
overrides only what it changes. The meaning of every key is documented
where it is declared: `config.model`'s beside its field in
`model/config.py`, the others beside TrainConfig's in
`train/base/train_config.py`.
"""

import dataclasses

import ml_collections
from ml_collections import config_dict

from model import attention
from model.attention import options as variant_options
from model.config import ModelConfig
from train.base import train_config
from train.data import datasets


def choice(arg: str, key: str, choices: tuple[str, ...], path: str) -> str:
  """The name of a config argument `key=<name>`, one of `choices`; a
  ValueError naming the config file `path` otherwise."""
  given, _, name = arg.partition('=')
  if given != key or name not in choices:
    raise ValueError(f'{path} takes {key}=<one of {choices}>, got {arg!r}.')
  return name


def attention_options() -> ml_collections.ConfigDict:
  """`config.model.attention_options`, every key unset: each option of
  every registered attention (config.model.attention_options.window), and
  the same under each attention's name, for a config that cycles several
  (config.model.attention_options.local.window). An unset option (None)
  takes the attention's default; a set one must be an option of the
  attention it reaches (train/config/validation.py). Under a name an
  option may give one value per occurrence of the attention in the
  pattern ('local,local': window=(1024, 128), or '1024,128' on the command
  line), so its type is checked there (ModelConfig), not here."""
  taken = {name: variant_options.option_types(name)
           for name in attention.names()}
  every = {}
  for types in taken.values():
    every |= types
  values = {option: config_dict.placeholder(kind)
            for option, kind in sorted(every.items())}
  for name, types in taken.items():
    values[name] = ml_collections.ConfigDict(
        {option: config_dict.placeholder(object) for option in sorted(types)})
  return ml_collections.ConfigDict(values)


def dataset_options() -> ml_collections.ConfigDict:
  """`config.dataset_options`, every option of every dataset unset (None:
  the dataset's default), so that one typed on the command line parses
  (`--config.dataset_options.paths='~/corpus/**/*.txt'`); a set one must be
  an option of config.dataset (train/data/datasets.py)."""
  return ml_collections.ConfigDict(
      {option: config_dict.placeholder(kind)
       for option, kind in sorted(datasets.option_types().items())})


def model_defaults() -> ml_collections.ConfigDict:
  """`config.model`: every ModelConfig field at its default."""
  values = {}
  for field in dataclasses.fields(ModelConfig):
    # The optional fields (num_kv_heads, head_dim) are ints that default to
    # None; a typed placeholder lets `--config.model.head_dim=64` parse.
    values[field.name] = (config_dict.placeholder(int) if field.default is None
                          else field.default)
  # The attention's options, e.g. config.model.attention_options.window.
  values['attention_options'] = attention_options()
  # Mixture of experts, e.g. config.model.moe.num_experts (0: off).
  values['moe'] = ml_collections.ConfigDict(
      dataclasses.asdict(ModelConfig().moe))
  return ml_collections.ConfigDict(values)


def get_config() -> ml_collections.ConfigDict:
  """Every training key at its default (train/base/train_config.py says
  what each means), and `config.model` (model/config.py)."""
  config = train_config.defaults()
  config.dataset_options = dataset_options()
  config.model = model_defaults()
  return config
