"""A config's model traced on the device mesh, and the checks of its
layout there, for train/config/validation.py: the strategy, and the batch,
the length and every parameter splitting evenly over the mesh (the logical
axis rules passed their key's rule before).
"""

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax

from model import ModelConfig, build
from model.attention.kernels import fused
from model.state import Memory
from train.base.errors import InputError
from train.base.train_config import TrainConfig
from train.data.tasks import Task
from train.program import mesh, sharding


# The config key behind each logical axis, to name it in an error.
_SIZE_KEYS = {'embed': 'model.d_model', 'heads': 'model.num_heads',
             'kv_heads': 'model.num_kv_heads', 'kv': 'model.head_dim',
             'mlp': 'model.mlp_dim', 'vocab': 'model.vocab_size',
             'length': 'model.max_len', 'expert': 'model.moe.num_experts'}


def _attention_setting(model_config: ModelConfig) -> str:
  """config.model's attention and options, as a config would write them."""
  if model_config.num_attentions == 1:
    return (f'attention={model_config.attention!r}, attention_options='
            f'{dict(model_config.attention_options)}')
  given = {}  # {attention: {option: its value at each occurrence}}
  for c in model_config.layer_configs():
    for option, value in c.attention_options:
      given.setdefault(c.attention, {}).setdefault(option, []).append(value)
  options = {name: {option: values[0] if len(set(values)) == 1
                    else tuple(values) for option, values in found.items()}
             for name, found in given.items()}
  return (f'attention={",".join(model_config.attention)!r}, '
          f'attention_options={options}')


@dataclasses.dataclass(frozen=True)
class Traced:
  """What tracing the model on a training batch tells (shapes only)."""

  # The parameters' shapes and logical names (nn.Partitioned leaves of
  # jax.ShapeDtypeStruct).
  param_shapes: Any
  # The choice of each fused-attention call, in call order (fused.py's
  # recording; train/config/kernels.py reads it).
  kernels: tuple[fused.Decision, ...]


def trace_model(config: TrainConfig, task: Task,
                device_mesh: jax.sharding.Mesh) -> Traced:
  """The model initialised, shapes only, on the task's synthetic batch of
  `config` (a training batch's shapes: packed rows, padded sources, a
  Transformer-XL memory), under `device_mesh` and the logical axis rules,
  as a training step calls it; InputError if it does not build."""
  model = build(config.model)

  def init(rng, batch):
    kwargs = {}
    if config.model.memory_length:
      kwargs['memory'] = Memory.empty(config.model, config.batch_size)
    return model.init(rng, *task.model_args(batch), **kwargs)['params']

  try:
    with (jax.set_mesh(device_mesh),
          nn.logical_axis_rules(config.logical_axis_rules),
          fused.recording() as decisions):
      param_shapes = jax.eval_shape(init, jax.random.key(config.seed),
                                    task.synthetic_batch(config))
  except ValueError as error:  # E.g. an attention refusing an option value.
    raise InputError(
        f'config.model does not build ({_attention_setting(config.model)}): '
        f'{error}') from None
  return Traced(param_shapes, tuple(decisions))


def check_parameters(config: TrainConfig, device_mesh: jax.sharding.Mesh,
                     param_shapes) -> None:
  """Every parameter (`param_shapes`, with their logical names) splits
  evenly over `device_mesh`."""
  # Unset, the key/value heads are the query heads: num_heads sets both.
  kv_heads = ('model.num_kv_heads'
              if config.model.num_kv_heads != config.model.num_heads
              else 'model.num_heads')
  _check_parameters(param_shapes, dict(device_mesh.shape),
                    config.logical_axis_rules,
                    size_keys={'kv_heads': kv_heads})


def check_splits(config: TrainConfig, device_mesh: jax.sharding.Mesh,
                 positions: int) -> None:
  """The batch and the length split evenly over `device_mesh`, and the
  strategy can run on it; `positions` is the length of the model's
  activations."""
  sizes = dict(device_mesh.shape)
  strategy = config.parallelism.strategy
  if strategy not in mesh.STRATEGIES:
    raise InputError(f'config.parallelism.strategy={strategy!r} must be one '
                     f'of {list(mesh.STRATEGIES)}.')
  if strategy == 'pmap':
    for axis in ('fsdp', 'tensor', 'sequence'):
      if sizes[axis] != 1:
        raise InputError(
            f'config.parallelism.{axis}={sizes[axis]}: the pmap strategy is '
            'data parallel only; use strategy=pjit to split parameters or '
            'sequences.')
  replicas = sizes['data'] * sizes['fsdp']
  if config.batch_size % replicas:
    raise InputError(
        f'config.batch_size={config.batch_size} must be divisible by the '
        f'{replicas} batch slices (config.parallelism.data={sizes["data"]} x '
        f'fsdp={sizes["fsdp"]}).')
  micro_batch = config.batch_size // config.grad_accum_steps
  if config.batch_size % config.grad_accum_steps or micro_batch % replicas:
    raise InputError(
        f'config.grad_accum_steps={config.grad_accum_steps} must split '
        f'config.batch_size={config.batch_size} into micro-batches divisible '
        f'by the {replicas} batch slices.')
  if positions % sizes['sequence']:
    raise InputError(
        f'config.seq_len={config.seq_len} ({positions} positions in the model) '
        f'must be divisible by config.parallelism.sequence='
        f'{sizes["sequence"]}.')


def _check_parameters(boxed_params, sizes: dict[str, int], rules,
                      size_keys: dict[str, str] | None = None) -> None:
  """Every parameter dim splits evenly over the mesh axes (of `sizes`) its
  logical name maps to; InputError naming the config keys otherwise.
  `size_keys` overrides the config key named for a logical axis."""
  size_keys = _SIZE_KEYS | (size_keys or {})
  leaves = jax.tree_util.tree_leaves_with_path(
      boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  for path, leaf in leaves:
    if not isinstance(leaf, nn.Partitioned):
      continue
    targets = nn.logical_to_mesh_axes(leaf.names, rules)
    for dim, name, target in zip(leaf.value.shape, leaf.names, targets):
      axes = sharding.mesh_axes(target)
      size = math.prod(sizes[axis] for axis in axes)
      if dim % size:
        over = ' x '.join(f'config.parallelism.{axis}={sizes[axis]}'
                          for axis in axes)
        raise InputError(
            f'config.{size_keys.get(name, name)}={dim} does not split over '
            f'{over} (logical axis {name!r} of parameter '
            f'{jax.tree_util.keystr(path, simple=True, separator="/")}).')
