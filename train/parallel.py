"""Where the train state and batches live on the mesh, and the train step.

Parameters carry logical axis names (embed, heads, kv_heads, kv, mlp, vocab,
length, expert; see model/layers.py, model/moe.py) and the Transformer
blocks constrain their
inputs to (activation_batch, activation_length, activation_embed).
`config.logical_axis_rules` maps each name to mesh axes (train/mesh.py); a
name without a rule is not split. DEFAULT_RULES give
  data parallelism      the batch over data and fsdp;
  FSDP                  every weight's embed dim over fsdp (each weight
                        matrix and embedding has one);
  tensor parallelism    heads, key/value heads, MLP units and vocabulary
                        over tensor;
  sequence parallelism  activations' length over sequence.
The experts of a mixture-of-experts layer are not split by default; a rule
('expert', 'fsdp') (or 'data') puts a share of them on each device (expert
parallelism), placed before ('embed', 'fsdp') so that it takes the axis.
A rule maps a name to one mesh axis or a tuple of them; for each array,
rules are tried in order and a mesh axis is used at most once.

Two strategies build the same update:
  pjit  `jax.jit` with the state and batch shardings and the state donated;
        XLA inserts every collective.
  pmap  the per-device program, written with `jax.shard_map` over the data
        axis: local gradients, then an explicit `lax.psum` of gradient and
        metric sums, then the same update on every device's replicated
        state. This is the program `jax.pmap` users write; data parallel
        only.
"""

from collections.abc import Callable
import contextlib
import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections

from model import ModelConfig, build, families, weight_decay
from train import mesh as mesh_lib
from train import optim, steps
from train.errors import InputError
from train.steps import TrainState

BATCH_AXES = mesh_lib.BATCH_AXES

DEFAULT_RULES = (
    ('activation_batch', BATCH_AXES),
    ('activation_length', 'sequence'),
    ('embed', 'fsdp'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('mlp', 'tensor'),
    ('vocab', 'tensor'),
)

# The config key behind each logical axis, to name it in an error.
_SIZE_KEYS = {'embed': 'model.d_model', 'heads': 'model.num_heads',
              'kv_heads': 'model.num_kv_heads', 'kv': 'model.head_dim',
              'mlp': 'model.mlp_dim', 'vocab': 'model.vocab_size',
              'length': 'model.max_len', 'expert': 'model.moe.num_experts'}


def _mesh_axes(target) -> tuple[str, ...]:
  """A rule's target as a tuple of mesh axes (None: none)."""
  if target is None:
    return ()
  return (target,) if isinstance(target, str) else tuple(target)


def logical_rules(config: ml_collections.ConfigDict):
  """`config.logical_axis_rules` as a tuple of (name, mesh axes) pairs."""
  rules = config.logical_axis_rules
  try:
    pairs = tuple((name, target) for name, target in rules)
  except (TypeError, ValueError):
    raise InputError(
        f'config.logical_axis_rules={rules!r} must be a sequence of '
        '(logical name, mesh axis or tuple of mesh axes) pairs.') from None
  for name, target in pairs:
    bad = [axis for axis in _mesh_axes(target)
           if axis not in mesh_lib.MESH_AXES]
    if not isinstance(name, str) or bad:
      raise InputError(
          f'config.logical_axis_rules: ({name!r}, {target!r}) must map a '
          f'name to mesh axes among {list(mesh_lib.MESH_AXES)}.')
  return tuple((name, tuple(target) if isinstance(target, list) else target)
               for name, target in pairs)


def check_layout(config: ml_collections.ConfigDict, sizes: dict[str, int],
                 positions: int) -> None:
  """The batch and the length split evenly over the mesh, and the strategy
  can run on it; `positions` is the length of the model's activations."""
  strategy = config.parallelism.strategy
  if strategy not in mesh_lib.STRATEGIES:
    raise InputError(f'config.parallelism.strategy={strategy!r} must be one '
                     f'of {list(mesh_lib.STRATEGIES)}.')
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


def check_parameters(boxed_params, sizes: dict[str, int], rules,
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
      axes = _mesh_axes(target)
      size = math.prod(sizes[axis] for axis in axes)
      if dim % size:
        over = ' x '.join(f'config.parallelism.{axis}={sizes[axis]}'
                          for axis in axes)
        raise InputError(
            f'config.{size_keys.get(name, name)}={dim} does not split over '
            f'{over} (logical axis {name!r} of parameter '
            f'{jax.tree_util.keystr(path, simple=True, separator="/")}).')


def state_shardings(abstract_state: TrainState, boxed_params, mesh: Mesh,
                    rules, *, replicate_params: bool = False) -> TrainState:
  """Shardings of every leaf of the train state.

  Parameters follow their logical names (or are replicated, for pmap); the
  optimizer's per-parameter statistics (Adam's moments) follow the
  parameters; a Transformer-XL memory is split by example like the batch.
  """
  replicated = NamedSharding(mesh, P())
  if replicate_params:
    params = jax.tree.map(lambda _: replicated, abstract_state.params)
  else:
    params = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(boxed_params), mesh, rules)
  structure = jax.tree.structure(abstract_state.params)

  def like_params(subtree) -> bool:
    return jax.tree.structure(subtree) == structure

  opt_state = jax.tree.map(
      lambda subtree: params if like_params(subtree) else replicated,
      abstract_state.opt_state, is_leaf=like_params)
  memory = None
  if abstract_state.memory is not None:
    memory = {'hidden': NamedSharding(mesh, P(None, BATCH_AXES)),
              'valid': NamedSharding(mesh, P(BATCH_AXES))}
  return TrainState(step=replicated, params=params, opt_state=opt_state,
                    memory=memory)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches (and per-example metrics) are split by example."""
  return NamedSharding(mesh, P(BATCH_AXES))


def global_batch(batch, sharding: NamedSharding):
  """The global arrays of a batch that every host holds whole (see
  train/data/pipeline.py); each host places the rows of its devices."""
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, x, x.shape),
      batch)


def jit_train_step(step_fn: Callable, strategy: str, mesh: Mesh,
                   state_sharding: TrainState) -> Callable:
  """`step_fn(state, batch, rng, device_axes=None) -> (state, metrics)` as
  the compiled step of `strategy`; the state argument is donated."""
  replicated = NamedSharding(mesh, P())
  batch = batch_sharding(mesh)
  if strategy == 'pjit':
    return jax.jit(step_fn,
                   in_shardings=(state_sharding, batch, replicated),
                   out_shardings=(state_sharding, replicated),
                   donate_argnums=0)

  state_specs = jax.tree.map(lambda sharding: sharding.spec, state_sharding)

  def per_device(state, batch, rng):
    # Each device draws its own dropout masks.
    rng = jax.random.fold_in(rng, jax.lax.axis_index(BATCH_AXES))
    # Every axis is manual here: no logical constraints apply.
    with nn.logical_axis_rules(()):
      return step_fn(state, batch, rng, device_axes=BATCH_AXES)

  program = jax.shard_map(per_device, mesh=mesh,
                          in_specs=(state_specs, batch.spec, P()),
                          out_specs=(state_specs, P()))
  return jax.jit(program, in_shardings=(state_sharding, batch, replicated),
                 out_shardings=(state_sharding, replicated), donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class Program:
  """A run's step functions, compiled for one mesh, and where its arrays go.

  Trace and run `train_step` and `eval_step` inside `scope()`.
  """

  mesh: Mesh
  rules: tuple
  seed: int
  # Shapes, dtypes and shardings of the train state (what a restore fills).
  abstract_state: TrainState
  state_sharding: TrainState
  batch_sharding: NamedSharding
  # () -> TrainState: fresh, laid out on the mesh.
  init: Callable[[], TrainState]
  # (state, batch, rng) -> (state, metric sums); the state is donated.
  train_step: Callable[..., tuple[TrainState, dict]]
  # (params, batch, memory) -> (metric sums, memory).
  eval_step: Callable[..., tuple[dict, Any]]
  # () -> an empty Transformer-XL memory (None without one).
  fresh_memory: Callable[[], Any]

  def key(self, index: int) -> jax.Array:
    """Key `index` of those the seed gives, the same on every host:
    0 initialises, 1 draws dropout, 2 samples."""
    return jax.jit(lambda: jax.random.split(jax.random.key(self.seed),
                                            3)[index],
                   out_shardings=NamedSharding(self.mesh, P()))()

  def replicate(self, tree):
    """`tree` whole on every device (so any host can read it)."""
    return jax.jit(lambda x: x, out_shardings=NamedSharding(self.mesh, P()))(
        tree)

  def batch(self, host_batch):
    """Global arrays of a batch every host holds whole."""
    return global_batch(host_batch, self.batch_sharding)

  def scope(self) -> contextlib.ExitStack:
    """The mesh and the logical axis rules, in which the steps are traced:
    activation constraints and the ring attention's shard_map find them
    there."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(self.rules))
    return stack


def compile_program(config: ml_collections.ConfigDict,
                    model_config: ModelConfig, kind: str,
                    mesh: Mesh) -> Program:
  """The Program of a validated config on `mesh` (jitted, compiled on first
  call)."""
  model = build(model_config)
  rng = jax.random.key(config.seed)
  boxed_params = jax.eval_shape(functools.partial(
      steps.init_params, model, kind, seq_len=config.seq_len, boxed=True),
      rng)
  optimizer, schedule = optim.make_optimizer(
      config, weight_decay.decay_mask(boxed_params))
  rules = logical_rules(config)
  replicated = NamedSharding(mesh, P())

  def empty_memory():
    if not model_config.memory_length:
      return None
    return families.empty_memory(model_config, config.batch_size)

  def init_state(rng):
    params = steps.init_params(model, kind, rng, config.seq_len)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), memory=empty_memory())

  abstract_state = jax.eval_shape(init_state, rng)
  strategy = config.parallelism.strategy
  state_sharding = state_shardings(abstract_state, boxed_params, mesh, rules,
                                   replicate_params=strategy == 'pmap')
  batch = batch_sharding(mesh)
  train_step = jit_train_step(
      functools.partial(steps.train_step, model=model, kind=kind,
                        optimizer=optimizer, schedule=schedule,
                        label_smoothing=config.label_smoothing,
                        grad_accum_steps=config.grad_accum_steps,
                        skip_nonfinite=config.nan_policy == 'skip'),
      strategy, mesh, state_sharding)
  eval_step = jax.jit(
      functools.partial(steps.eval_step, model=model, kind=kind),
      in_shardings=(state_sharding.params, batch, state_sharding.memory),
      out_shardings=(replicated, state_sharding.memory))
  seed = config.seed
  init = jax.jit(
      lambda: init_state(jax.random.split(jax.random.key(seed), 3)[0]),
      out_shardings=state_sharding)
  return Program(
      mesh=mesh, rules=rules, seed=seed,
      abstract_state=jax.tree.map(
          lambda leaf, sharding: jax.ShapeDtypeStruct(
              leaf.shape, leaf.dtype, sharding=sharding),
          abstract_state, state_sharding),
      state_sharding=state_sharding, batch_sharding=batch, init=init,
      train_step=train_step, eval_step=eval_step,
      fresh_memory=jax.jit(empty_memory,
                           out_shardings=state_sharding.memory))
