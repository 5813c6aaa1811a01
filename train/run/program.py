"""A run's program: its config checked, its mesh, and its step functions
compiled for that mesh. `Program.from_config(config)` builds it once, for
the trainer, trained runs, benchmarks and comparisons alike.

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
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np

from model import ModelConfig, build
from model.attention.kernels import fused
from model.state import Memory
from train.base.train_config import TrainConfig
from train.config import validation as config_validation
from train.data.tasks import Task
from train.program import optim, sharding, steps, windows
from train.program.steps import TrainState


def jit_train_step(step_fn: Callable, strategy: str, mesh: Mesh,
                   state_sharding: TrainState, *,
                   stacked: bool = False) -> Callable:
  """`step_fn(state, batch, rng, device_axes=None) -> (state, metrics)` as
  the compiled step of `strategy`; the state argument is donated.
  `stacked`: the batch is [K, B, ...], K steps' (steps.train_steps)."""
  replicated = NamedSharding(mesh, P())
  batch = sharding.batch_sharding(mesh, stacked=stacked)
  if strategy == 'pjit':
    return jax.jit(step_fn,
                   in_shardings=(state_sharding, batch, replicated),
                   out_shardings=(state_sharding, replicated),
                   donate_argnums=0)

  state_specs = jax.tree.map(lambda leaf: leaf.spec, state_sharding)

  def per_device(state, batch, rng):
    # Each device draws its own dropout masks.
    rng = jax.random.fold_in(rng, jax.lax.axis_index(sharding.BATCH_AXES))
    # Every axis is manual here: no logical constraints apply.
    with nn.logical_axis_rules(()):
      return step_fn(state, batch, rng, device_axes=sharding.BATCH_AXES)

  program = jax.shard_map(per_device, mesh=mesh,
                          in_specs=(state_specs, batch.spec, P()),
                          out_specs=(state_specs, P()))
  return jax.jit(program, in_shardings=(state_sharding, batch, replicated),
                 out_shardings=(state_sharding, replicated), donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class Program:
  """A run's model and step functions, compiled for one mesh, and where its
  arrays go.

  Trace and run `train_step` and `eval_step` inside `scope()`.
  """

  config: TrainConfig
  task: Task
  model: nn.Module
  mesh: Mesh
  # Shapes, dtypes and shardings of the train state (what a restore fills).
  abstract_state: TrainState
  state_sharding: TrainState
  batch_sharding: NamedSharding
  # () -> TrainState: fresh, laid out on the mesh.
  init: Callable[[], TrainState]
  # () -> the fresh state's parameters alone, laid out on the mesh.
  init_params: Callable[[], Any]
  # params -> TrainState: step 0 and a fresh optimizer state with these
  # parameters (shaped as abstract_state's), laid out on the mesh.
  start_from: Callable[[Any], TrainState]
  # (state, batch, rng) -> (state, metric sums); the state is donated.
  train_step: Callable[..., tuple[TrainState, dict]]
  # config.steps_per_call > 1: (state, batches [K, B, ...], rng) -> (state,
  # metric sums stacked [K]), K steps in one call; else None.
  train_steps: Callable[..., tuple[TrainState, dict]] | None
  # (params, batch, memory) -> (metric sums, memory).
  eval_step: Callable[..., tuple[dict, Any]]
  # () -> an empty Transformer-XL memory (None without one).
  fresh_memory: Callable[[], Any]
  # The choice of each fused-kernel call of a training step, in call order
  # (train/config/kernels.py).
  kernels: tuple[fused.Decision, ...] = ()

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict,
                  devices=None) -> 'Program':
    """The program of `config` on a mesh of `devices` (default: every
    device of every host); InputError naming every bad key, checked for
    that mesh, first."""
    checked = config_validation.check(config, devices)
    return compile_program(checked.config, checked.task, checked.mesh,
                           param_shapes=checked.param_shapes,
                           kernels=checked.kernels)

  @property
  def model_config(self) -> ModelConfig:
    return self.config.model

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.abstract_state.params))

  def key(self, index: int) -> jax.Array:
    """Key `index` of those the seed gives, the same on every host:
    0 initialises, 1 draws dropout, 2 samples."""
    return jax.jit(lambda: jax.random.split(
        jax.random.key(self.config.seed), 3)[index],
                   out_shardings=NamedSharding(self.mesh, P()))()

  def replicate(self, tree):
    """`tree` whole on every device (so any host can read it)."""
    return jax.jit(lambda x: x, out_shardings=NamedSharding(self.mesh, P()))(
        tree)

  def batch(self, host_batch):
    """Global arrays of a batch of which this host holds its rows
    (`local_rows`) or all."""
    return sharding.global_batch(host_batch, self.batch_sharding,
                                 self.config.batch_size)

  def place(self, host_batches: list[dict]):
    """The batch argument of `train_step` (one batch) or of `train_steps`
    (several, stacked [K, B, ...]) from this host's rows of each. On one
    host it stays numpy: the jitted step's own dispatch moves it to the
    devices its in_shardings name, at a fraction of device_put's cost
    (7 against 120 us for lm_stdlib's batch on the CPU); on several, each
    host places its rows of the global arrays."""
    batch = (host_batches[0] if len(host_batches) == 1 else jax.tree.map(
        lambda *steps: np.stack(steps), *host_batches))
    if jax.process_count() == 1:
      return batch
    return sharding.global_batch(
        batch, sharding.batch_sharding(self.mesh,
                                       stacked=len(host_batches) > 1),
        self.config.batch_size, stacked=len(host_batches) > 1)

  @property
  def local_rows(self) -> tuple[int, ...]:
    """The rows of each batch that this host's devices hold, and so the
    ones its training pipeline prepares."""
    return sharding.process_rows(self.batch_sharding, self.config.batch_size)

  def for_window(self, window: int) -> 'Program':
    """This program with the model's long windows `window`
    (config.window_schedule's stages): the same state and layout, its
    steps compiled for that model. Its kernel choices are the configured
    model's, as traced: the kernel table reads whether a layer has a
    window, not its size (model/attention/kernels/fused.py)."""
    config = dataclasses.replace(self.config, model=windows.with_long_window(
        self.model_config, window))
    return compile_program(config, self.task, self.mesh,
                           kernels=self.kernels)

  def scope(self) -> contextlib.ExitStack:
    """The mesh and the logical axis rules, in which the steps are traced:
    activation constraints and the ring attention's shard_map find them
    there."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(
        nn.logical_axis_rules(self.config.logical_axis_rules))
    return stack


def compile_program(config: TrainConfig, task: Task, mesh: Mesh, *,
                    param_shapes=None, kernels=()) -> Program:
  """The Program of a checked config on `mesh` (jitted, compiled on first
  call). `param_shapes`: the parameters' shapes with their logical names
  (nn.Partitioned leaves of jax.ShapeDtypeStruct), as the config check's
  trace found them (train/config/layout.py), else traced here;
  `kernels`: the fused-kernel choices that trace recorded.
  """
  model_config = config.model
  model = build(model_config)
  if param_shapes is None:
    param_shapes = jax.eval_shape(functools.partial(
        steps.init_params, model, task, seq_len=config.seq_len, boxed=True),
        jax.random.key(config.seed))
  optimizer, learning_rates = optim.make_optimizer(config, param_shapes)
  rules = config.logical_axis_rules
  replicated = NamedSharding(mesh, P())

  def empty_memory():
    if not model_config.memory_length:
      return None
    return Memory.empty(model_config, config.batch_size)

  def fresh_state(params) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), memory=empty_memory())

  abstract_state = jax.eval_shape(fresh_state, nn.meta.unbox(param_shapes))
  strategy = config.parallelism.strategy
  state_sharding = sharding.state_shardings(
      abstract_state, param_shapes, mesh, rules,
      replicate_params=strategy == 'pmap')
  batch = sharding.batch_sharding(mesh)
  step_options = dict(model=model, task=task, optimizer=optimizer,
                      learning_rates=learning_rates,
                      label_smoothing=config.label_smoothing,
                      z_loss=config.z_loss,
                      grad_accum_steps=config.grad_accum_steps,
                      skip_nonfinite=config.nan_policy == 'skip')
  train_step = jit_train_step(
      functools.partial(steps.train_step, **step_options), strategy, mesh,
      state_sharding)
  train_steps = None
  if config.steps_per_call > 1:
    train_steps = jit_train_step(
        functools.partial(steps.train_steps, **step_options), strategy,
        mesh, state_sharding, stacked=True)
  eval_step = jax.jit(
      functools.partial(steps.eval_step, model=model, task=task),
      in_shardings=(state_sharding.params, batch, state_sharding.memory),
      out_shardings=(replicated, state_sharding.memory))
  seed = config.seed

  def fresh_params():
    return steps.init_params(model, task,
                             jax.random.split(jax.random.key(seed), 3)[0],
                             config.seq_len)
  return Program(
      config=config, task=task, model=model, mesh=mesh,
      abstract_state=jax.tree.map(
          lambda leaf, leaf_sharding: jax.ShapeDtypeStruct(
              leaf.shape, leaf.dtype, sharding=leaf_sharding),
          abstract_state, state_sharding),
      state_sharding=state_sharding, batch_sharding=batch,
      init=jax.jit(lambda: fresh_state(fresh_params()),
                   out_shardings=state_sharding),
      init_params=jax.jit(fresh_params, out_shardings=state_sharding.params),
      start_from=jax.jit(fresh_state, out_shardings=state_sharding),
      train_step=train_step, train_steps=train_steps,
      eval_step=eval_step,
      fresh_memory=jax.jit(empty_memory,
                           out_shardings=state_sharding.memory),
      kernels=kernels)
