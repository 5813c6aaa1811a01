"""What a model family declares about itself, for the code around it."""

from collections.abc import Callable
import dataclasses

import flax.linen as nn

from model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its module, what it trains on, and what the checks
  and the FLOPs count ask of it."""

  name: str
  # Built with the ModelConfig: module(config).
  module: type[nn.Module]
  # The tasks (train/data/tasks.py) it trains on, by name.
  tasks: tuple[str, ...]
  # Attention layers a token's step attends over the whole length through,
  # forward (model FLOPs, train/program/flops.py).
  attention_layers: Callable[[ModelConfig], int]
  # The module's method that reads a row of inputs alone: what the maps of
  # its self-attention feed (experiments/attention_maps.py); None for a
  # family with no self-attention.
  inputs_method: str | None = '__call__'
  # Activations beyond the tokens (a classifier's CLS vector).
  extra_positions: Callable[[ModelConfig], int] = lambda config: 0
  # Forward steps that must run one after another for `length` tokens.
  sequential_steps: Callable[[ModelConfig, int], int] = (
      lambda config, length: 2 * config.num_layers)
  # Its feed-forward layers are Transformer blocks' (config.model.moe).
  feed_forward: bool = True
  # It can keep a Transformer-XL memory (config.model.memory_length).
  memory: bool = False
  # Its attention is multi-head attention over projected queries and keys
  # (config.model.qk_norm).
  multi_head: bool = True
  # It has a causal decoder, which a bidirectional-only attention cannot be.
  decoder: bool = True
  # It is one causal stack over its own tokens (a decoder-only LM), which
  # config.model's smear, value_embeddings and unet_skips are defined for.
  causal_stack: bool = False
  # It draws a randomized position scheme's positions in training
  # (PositionScheme.randomized).
  random_positions: bool = False
