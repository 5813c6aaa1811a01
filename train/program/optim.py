"""The optimizer and learning-rate schedule named by the config."""

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from model.matrices import Matrix, hidden_matrices, is_entry
from model.weight_decay import decay_mask
from train.base.train_config import TrainConfig
from train.program.muon import normalise_neurons, scale_by_muon


def wsd_cooldown_steps(config: TrainConfig) -> int:
  """The steps of wsd's decay: the last `decay_fraction` of the run, at
  least one."""
  return max(round(config.decay_fraction * config.num_train_steps), 1)


def _ramp(config: TrainConfig) -> optax.Schedule:
  """The warmup: linear from 0 to the peak over `warmup_steps`."""
  return optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)


def _after_warmup(config: TrainConfig,
                  decay: optax.Schedule) -> optax.Schedule:
  """The warmup's ramp, then `decay` counted from its end."""
  if config.warmup_steps == 0:
    return decay
  return optax.join_schedules([_ramp(config), decay], [config.warmup_steps])


def _final(config: TrainConfig) -> float:
  return config.learning_rate * config.final_learning_rate_fraction


def _decay_steps(config: TrainConfig) -> int:
  return max(config.num_train_steps - config.warmup_steps, 1)


def _cosine(config: TrainConfig) -> optax.Schedule:
  return _after_warmup(config, optax.cosine_decay_schedule(
      config.learning_rate, _decay_steps(config),
      alpha=config.final_learning_rate_fraction))


def _linear(config: TrainConfig) -> optax.Schedule:
  return _after_warmup(config, optax.linear_schedule(
      config.learning_rate, _final(config), _decay_steps(config)))


def _rsqrt(config: TrainConfig) -> optax.Schedule:
  peak, warmup = config.learning_rate, max(config.warmup_steps, 1)
  return _after_warmup(
      config, lambda count: peak * jnp.sqrt(warmup / (count + warmup)))


def _constant(config: TrainConfig) -> optax.Schedule:
  return _after_warmup(config, optax.constant_schedule(config.learning_rate))


def _wsd(config: TrainConfig) -> optax.Schedule:
  peak, cooldown = config.learning_rate, wsd_cooldown_steps(config)

  def peak_then_cooldown(steps_at_peak: int) -> optax.Schedule:
    return optax.join_schedules(
        [optax.constant_schedule(peak),
         optax.linear_schedule(peak, _final(config), cooldown)],
        [steps_at_peak])
  stable = config.num_train_steps - config.warmup_steps - cooldown
  if stable < 0:  # The line over the whole run, from step 0.
    line = peak_then_cooldown(config.num_train_steps - cooldown)
    ramp = _ramp(config)
    return lambda count: jnp.minimum(ramp(count), line(count))
  return _after_warmup(config, peak_then_cooldown(stable))


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A learning-rate schedule (config.schedule): linear warmup over
  `warmup_steps` to the peak `learning_rate`, then its own course."""

  # config -> the rate at each step.
  build: Callable[[TrainConfig], optax.Schedule]
  # Its rates do not depend on num_train_steps, so a run on it may be
  # extended or shortened when it resumes.
  length_free: bool = False


SCHEDULES = {
    # Decay to `final_learning_rate_fraction * learning_rate` at
    # num_train_steps, along half a cosine or a line.
    'cosine': Schedule(_cosine),
    'linear': Schedule(_linear),
    # peak * sqrt(warmup_steps / step) (Vaswani et al. 2017).
    'rsqrt': Schedule(_rsqrt, length_free=True),
    # Stay at the peak.
    'constant': Schedule(_constant, length_free=True),
    # Warmup-stable-decay (Hu et al. 2024): stay at the peak, then decay
    # linearly to `final_learning_rate_fraction * learning_rate` over the
    # last `decay_fraction` of `num_train_steps` (wsd_cooldown_steps). A
    # run too short for both (warmup_steps + cooldown > num_train_steps, a
    # smoke run) takes the lower of the warmup's ramp and the cooldown's
    # line: it rises on the ramp until it meets the line and follows it
    # down, still ending at the final rate at num_train_steps (unless the
    # ramp is lower still there); it never reaches the peak, and
    # config_validation.warnings_of says so.
    'wsd': Schedule(_wsd),
}


def length_free_schedules() -> list[str]:
  """The schedules a run may change num_train_steps under."""
  return [name for name, schedule in SCHEDULES.items() if schedule.length_free]


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
  """The rate at each step of `config.schedule` (SCHEDULES)."""
  return SCHEDULES[config.schedule].build(config)


def add_decayed_weights(config: TrainConfig, mask=None
                        ) -> optax.GradientTransformation:
  """Decoupled weight decay, update + weight_decay * parameter where
  `mask` (a tree of booleans, or None for all) says; under
  config.cautious_weight_decay only where the update (the direction the
  step subtracts) and the parameter agree in sign (or either is zero), so
  that decay never pulls against the step (Chen et al. 2025)."""
  if not config.cautious_weight_decay:
    return optax.add_decayed_weights(config.weight_decay, mask=mask)
  decay = config.weight_decay

  def update_fn(updates, state, params):
    return jax.tree.map(
        lambda u, p: u + jnp.where(u * p >= 0, decay * p, 0).astype(u.dtype),
        updates, params), state

  cautious = optax.GradientTransformation(optax.init_empty_state, update_fn)
  return cautious if mask is None else optax.masked(cautious, mask)


def _adamw(config: TrainConfig, schedule: optax.Schedule, boxed_params
           ) -> optax.GradientTransformation:
  """optax.adamw's chain, its weight decay add_decayed_weights'."""
  return optax.chain(
      optax.scale_by_adam(b1=config.adam_b1, b2=config.adam_b2,
                          eps=config.adam_eps),
      add_decayed_weights(config, decay_mask(boxed_params)),
      optax.scale_by_learning_rate(schedule))


def _sgd(config: TrainConfig, schedule: optax.Schedule, boxed_params
         ) -> optax.GradientTransformation:
  return optax.chain(
      optax.add_decayed_weights(config.weight_decay,
                                mask=decay_mask(boxed_params)),
      optax.sgd(schedule, momentum=config.sgd_momentum or None))


def scale_by_width(matrices) -> optax.GradientTransformation:
  """Each matrix's update times sqrt(max(1, outputs / inputs)) (Jordan et
  al. 2024), so that a wide layer's update moves its outputs as much as a
  square one's. `matrices`: the Matrix of each leaf the updates hold."""
  def scale(update, matrix: Matrix):
    inputs, outputs = matrix.sizes(update.shape)
    return update * max(1.0, outputs / inputs) ** 0.5

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(scale, updates, matrices,
                        is_leaf=lambda leaf: isinstance(leaf, Matrix)), state
  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _muon(config: TrainConfig, schedule: optax.Schedule, boxed_params,
          *, normuon: bool = False) -> optax.GradientTransformation:
  """Muon (Jordan et al. 2024) on the hidden matrices (model/matrices.py),
  AdamW on every other parameter. A matrix's update is its Nesterov
  momentum orthogonalised by five Newton-Schulz steps (train/program/
  muon.py: optax's arithmetic, each shape's matrices batched), for
  `normuon` each neuron's part normalised (muon.normalise_neurons), times
  sqrt(max(1, outputs / inputs)), plus weight decay, times the schedule
  scaled to peak at `muon_learning_rate`."""
  matrices = hidden_matrices(boxed_params)
  labels = jax.tree.map(lambda matrix: 'adamw' if matrix is None else 'muon',
                        matrices, is_leaf=is_entry)
  # The tree of Muon's own leaves: optax.partition hands it the updates
  # with every other leaf masked.
  muon_leaves = jax.tree.map(
      lambda matrix: optax.MaskedNode() if matrix is None else matrix,
      matrices, is_leaf=is_entry)
  direction = [scale_by_muon(muon_leaves, beta=config.muon_momentum)]
  if normuon:
    direction.append(normalise_neurons(muon_leaves,
                                       beta=config.normuon_beta2))
  return optax.partition({
      'muon': optax.chain(
          *direction, scale_by_width(muon_leaves),
          add_decayed_weights(config),
          optax.scale_by_learning_rate(_muon_schedule(config, schedule))),
      'adamw': _adamw(config, schedule, boxed_params),
  }, labels)


def _muon_schedule(config: TrainConfig, schedule: optax.Schedule
                   ) -> optax.Schedule:
  """The schedule of the matrices Muon updates: `schedule` scaled to peak
  at `muon_learning_rate`."""
  ratio = config.muon_learning_rate / config.learning_rate
  return lambda count: ratio * schedule(count)


def _muon_rates(config: TrainConfig, schedule: optax.Schedule
                ) -> dict[str, optax.Schedule]:
  """AdamW's rate (embeddings, gains, biases) and Muon's (the matrices)."""
  return {'learning_rate': schedule,
          'muon_learning_rate': _muon_schedule(config, schedule)}


def _one_rate(config: TrainConfig, schedule: optax.Schedule
              ) -> dict[str, optax.Schedule]:
  del config
  return {'learning_rate': schedule}


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """An optimizer (config.optimizer), with weight decay
  (model/weight_decay.py) on what it reaches."""

  # (config, the schedule, the parameters as declared) -> the update.
  build: Callable[[TrainConfig, optax.Schedule, Any],
                  optax.GradientTransformation]
  # The config keys of its own that it reads (not every optimizer's, such
  # as weight_decay), so that one set for another is warned of.
  reads: tuple[str, ...] = ()
  # (config, the schedule) -> each rate it applies, by the config key that
  # sets its peak: the names a run logs them under.
  rates: Callable[[TrainConfig, optax.Schedule],
                  dict[str, optax.Schedule]] = _one_rate


# What adamw reads of its own; muon's AdamW half too.
_ADAMW_KEYS = ('adam_b1', 'adam_b2', 'adam_eps', 'cautious_weight_decay')
OPTIMIZERS = {
    'adamw': Optimizer(_adamw, reads=_ADAMW_KEYS),
    'sgd': Optimizer(_sgd, reads=('sgd_momentum',)),
    # AdamW on the parameters that are not hidden matrices.
    'muon': Optimizer(_muon, reads=(*_ADAMW_KEYS, 'muon_learning_rate',
                                    'muon_momentum'), rates=_muon_rates),
    # Muon with each neuron's update normalised (Li et al. 2025).
    'normuon': Optimizer(functools.partial(_muon, normuon=True), reads=(
        *_ADAMW_KEYS, 'muon_learning_rate', 'muon_momentum',
        'normuon_beta2'), rates=_muon_rates),
}


def optimizer_keys() -> dict[str, list[str]]:
  """Each key an optimizer reads of its own (Optimizer.reads): the
  optimizers that read it."""
  readers = {}
  for name, optimizer in OPTIMIZERS.items():
    for key in optimizer.reads:
      readers.setdefault(key, []).append(name)
  return readers


def make_optimizer(config: TrainConfig, boxed_params
                   ) -> tuple[optax.GradientTransformation,
                              dict[str, optax.Schedule]]:
  """Clipping by global norm, then `config.optimizer` (OPTIMIZERS) on the
  schedule; and each rate it applies by name (Optimizer.rates).
  `boxed_params`: the parameters (or their shapes) as `init` made them,
  before nn.meta.unbox."""
  schedule = learning_rate_schedule(config)
  chosen = OPTIMIZERS[config.optimizer]
  optimizer = chosen.build(config, schedule, boxed_params)
  if config.grad_clip_norm > 0:
    optimizer = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm),
                            optimizer)
  if config.trained_params == 'attention':
    # Frozen gradients do not count in the clipping, nor frozen
    # parameters' decay in the updates.
    freeze = optax.masked(optax.set_to_zero(), _outside_attention)
    optimizer = optax.chain(freeze, optimizer, freeze)
  return optimizer, chosen.rates(config, schedule)


def _outside_attention(params) -> Any:
  """True at the parameters outside the self-attention layers."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: all(getattr(key, 'key', None) != 'self_attention'
                          for key in path), params)
