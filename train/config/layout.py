"""Checks of a config's layout on the device mesh, for
train/config/validation.py: the strategy, the logical axis rules, and the
batch, the length and every parameter splitting evenly over the mesh.
"""

import functools
import math

import flax.linen as nn
import jax
import ml_collections

from model import ModelConfig, build
from train.base.errors import InputError
from train.data.tasks import Task
from train.program import mesh, sharding, steps


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
  options = {c.attention: dict(c.attention_options)
             for c in model_config.layer_configs() if c.attention_options}
  return (f'attention={",".join(model_config.attention)!r}, '
          f'attention_options={options}')


def check_layout(config: ml_collections.ConfigDict, model_config: ModelConfig,
                 task: Task, positions: int, devices=None):
  """The mesh fits `devices` (default: every device of every host), and
  the batch, the length (`positions` in the model) and every parameter
  split evenly over it (shapes only: nothing is computed). Returns the
  parameters' shapes and logical names."""
  sizes = dict(mesh.make_mesh(config.parallelism, devices).shape)
  _check_splits(config, sizes, positions)
  rules = checked_rules(config)
  try:
    boxed_params = jax.eval_shape(functools.partial(
        steps.init_params, build(model_config), task, seq_len=config.seq_len,
        boxed=True), jax.random.key(config.seed))
  except ValueError as error:  # E.g. an attention refusing an option value.
    raise InputError(
        f'config.model does not build ({_attention_setting(model_config)}): '
        f'{error}') from None
  # Unset, the key/value heads are the query heads.
  kv_heads = ('model.num_kv_heads' if config.model.num_kv_heads is not None
              else 'model.num_heads')
  _check_parameters(boxed_params, sizes, rules,
                    size_keys={'kv_heads': kv_heads})
  return boxed_params


def checked_rules(config: ml_collections.ConfigDict) -> tuple:
  """`config.logical_axis_rules`, each a logical name and mesh axes, as
  sharding.logical_rules reads them."""
  rules = config.logical_axis_rules
  try:
    pairs = tuple((name, target) for name, target in rules)
  except (TypeError, ValueError):
    raise InputError(
        f'config.logical_axis_rules={rules!r} must be a sequence of '
        '(logical name, mesh axis or tuple of mesh axes) pairs.') from None
  for name, target in pairs:
    bad = [axis for axis in sharding.mesh_axes(target)
           if axis not in mesh.MESH_AXES]
    if not isinstance(name, str) or bad:
      raise InputError(
          f'config.logical_axis_rules: ({name!r}, {target!r}) must map a '
          f'name to mesh axes among {list(mesh.MESH_AXES)}.')
  return sharding.logical_rules(config)


def _check_splits(config: ml_collections.ConfigDict, sizes: dict[str, int],
                  positions: int) -> None:
  """The batch and the length split evenly over the mesh, and the strategy
  can run on it; `positions` is the length of the model's activations."""
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
