"""Which kernel each self-attention of a config's model runs in training
(see model/attention/fused.py), worked out from the config before anything
is traced: for the config check, which refuses a kernel named in
`config.model.attention_options.kernel` that cannot compute what the model
asks of it, and for the trainer's start-up line.

Cached decoding (a query at a time against a key/value cache, under a mask
array) always takes 'auto': no fused kernel reads a cache.
"""

import dataclasses
import inspect
import math

import flax.linen as nn
import jax
import ml_collections

from model import ModelConfig, attention, logical_axes
from model.attention import options as variant_options
from model.attention import fused
from model.positions import SCHEMES
from model.families import FAMILIES
from train.config import layout as layout_validation
from train.program import mesh, sharding


@dataclasses.dataclass(frozen=True)
class Choice:
  """The kernel of one stack's self-attention layers of one entry of the
  attention pattern."""

  stack: str  # 'decoder' or 'encoder'.
  layers: tuple[int, ...]
  attention: str
  key: str  # The config key of its kernel option.
  option: str  # The option's value ('auto' unset).
  case: fused.Case
  # What runs; None where `option` cannot compute the case (`refusal`).
  kernel: str | None
  refusal: str | None

  def describe(self) -> str:
    layers = (f'layer {self.layers[0]}' if len(self.layers) == 1 else
              f'layers {",".join(map(str, self.layers))}')
    how = ('auto' if self.option == 'auto' else 'as set') + (
        f'; {self.case.describe()}')
    return f'{self.stack} {layers} {self.attention}: {self.kernel} ({how})'


def _window(layer_config: ModelConfig) -> int | None:
  """local's window, as set or by default; None for other attentions."""
  if layer_config.attention != 'local':
    return None
  default = inspect.signature(attention.get('local')).parameters['window']
  return dict(layer_config.attention_options).get('window', default.default)


def _length_shards(config: ml_collections.ConfigDict, devices) -> int:
  """The devices `config`'s rules split the activations' length over."""
  sizes = mesh.axis_sizes(config.parallelism,
                          len(jax.devices() if devices is None else devices))
  target = nn.logical_to_mesh_axes((logical_axes.LENGTH,),
                                   layout_validation.checked_rules(config))[0]
  return math.prod(sizes[axis] for axis in sharding.mesh_axes(target))


def choices(config: ml_collections.ConfigDict, model_config: ModelConfig,
            length: int, backend: str | None = None,
            devices=None) -> list[Choice]:
  """The kernel of every self-attention that takes one, on `backend`
  (default: this process's), at activations of `length` positions, on a
  mesh of `devices` (default: every device of every host)."""
  here, capability = fused.device_description()
  backend = backend or here
  if backend != here:
    capability = None
  length_shards = _length_shards(config, devices)
  scheme = SCHEMES[model_config.position]
  bias = scheme.bias_kind if scheme.bias else 'none'
  max_segments = model_config.max_segments_per_row + 1  # With padding.
  found = []
  stacks = FAMILIES[model_config.family].self_attention(
      model_config, length, config.pack_sequences)
  for stack, is_causal, mask, q_len, kv_len in stacks:
    for index, layer_config in enumerate(model_config.layer_configs()):
      name = layer_config.attention
      if not variant_options.takes_kernel(name):
        continue
      option = dict(layer_config.attention_options).get('kernel', 'auto')
      case = fused.Case(backend, model_config.compute_dtype.name,
                        model_config.head_dim, q_len, kv_len, is_causal,
                        mask, bias, _window(layer_config), length_shards,
                        capability, max_segments)
      reason = None
      if option in fused.KERNELS and option != 'auto':
        reason = fused.refusal(option, case)
      kernel = None
      if option in fused.KERNELS and reason is None:
        kernel = fused.choose(option, case)
      found.append(Choice(
          stack, tuple(range(index, model_config.num_layers,
                             model_config.num_attentions)), name,
          model_config.option_key(name, 'kernel'), option, case, kernel,
          reason))
  return found
