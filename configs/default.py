"""Defaults shared by every experiment config.

Each experiment's `get_config()` starts from `get_config()` here and
overrides only what it changes. The meaning of every `config.model` key is
documented beside its field in `model/config.py`.
"""

import dataclasses

import ml_collections
from ml_collections import config_dict

from model.config import ModelConfig


def model_defaults() -> ml_collections.ConfigDict:
  """`config.model`: every ModelConfig field at its default."""
  values = {}
  for field in dataclasses.fields(ModelConfig):
    # The optional fields (num_kv_heads, head_dim) are ints that default to
    # None; a typed placeholder lets `--config.model.head_dim=64` parse.
    values[field.name] = (config_dict.placeholder(int) if field.default is None
                          else field.default)
  return ml_collections.ConfigDict(values)


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # Seeds parameter initialisation (and, later, data order and dropout).
  config.seed = 0
  config.model = model_defaults()
  return config
