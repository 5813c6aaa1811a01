"""The optimizer and learning-rate schedule named by the config."""

from collections.abc import Callable
import dataclasses

import jax.numpy as jnp
import optax

from train.base.train_config import TrainConfig


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


def make_optimizer(config: TrainConfig, decay_mask
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Clipping by global norm, then `config.optimizer` on the schedule,
  with weight decay on the parameters `decay_mask` marks (a tree of bools
  like the parameters': see model/weight_decay.py)."""
  schedule = learning_rate_schedule(config)
  if config.optimizer == 'adamw':
    optimizer = optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2,
                            eps=config.adam_eps,
                            weight_decay=config.weight_decay, mask=decay_mask)
  else:
    optimizer = optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
        optax.sgd(schedule, momentum=config.sgd_momentum or None))
  if config.grad_clip_norm > 0:
    optimizer = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm),
                            optimizer)
  return optimizer, schedule
