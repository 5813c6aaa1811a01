"""The optimizer and learning-rate schedule named by the config."""

import jax.numpy as jnp
import ml_collections
import optax

SCHEDULES = ('cosine', 'linear', 'rsqrt', 'constant', 'wsd')
OPTIMIZERS = ('adamw', 'sgd')


def wsd_cooldown_steps(config: ml_collections.ConfigDict) -> int:
  """The steps of wsd's decay: the last `decay_fraction` of the run, at
  least one."""
  return max(round(config.decay_fraction * config.num_train_steps), 1)


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup over `warmup_steps`, then `config.schedule`:

  cosine / linear: decay to `final_learning_rate_fraction * learning_rate`
    at `num_train_steps`;
  rsqrt: peak * sqrt(warmup_steps / step) (Vaswani et al. 2017);
  constant: stay at the peak;
  wsd: warmup-stable-decay (Hu et al. 2024): stay at the peak, then decay
    linearly to `final_learning_rate_fraction * learning_rate` over the
    last `decay_fraction` of `num_train_steps` (wsd_cooldown_steps). A run
    too short for both (warmup_steps + cooldown > num_train_steps, a smoke
    run) takes the lower of the warmup's ramp and the cooldown's line: it
    rises on the ramp until it meets the line and follows it down, still
    ending at the final rate at num_train_steps (unless the ramp is lower
    still there); it never reaches the peak, and
    config_validation.warnings_of says so.
  """
  peak, warmup = config.learning_rate, config.warmup_steps
  decay_steps = max(config.num_train_steps - warmup, 1)
  final = peak * config.final_learning_rate_fraction
  ramp = optax.linear_schedule(0.0, peak, warmup)
  if config.schedule == 'wsd':
    cooldown = wsd_cooldown_steps(config)

    def peak_then_cooldown(steps_at_peak: int) -> optax.Schedule:
      return optax.join_schedules(
          [optax.constant_schedule(peak),
           optax.linear_schedule(peak, final, cooldown)], [steps_at_peak])
    stable = config.num_train_steps - warmup - cooldown
    if stable < 0:  # The line over the whole run, from step 0.
      line = peak_then_cooldown(config.num_train_steps - cooldown)
      return lambda count: jnp.minimum(ramp(count), line(count))
    decay = peak_then_cooldown(stable)
  elif config.schedule == 'cosine':
    decay = optax.cosine_decay_schedule(
        peak, decay_steps, alpha=config.final_learning_rate_fraction)
  elif config.schedule == 'linear':
    decay = optax.linear_schedule(peak, final, decay_steps)
  elif config.schedule == 'rsqrt':
    def decay(count):
      return peak * jnp.sqrt(max(warmup, 1) / (count + max(warmup, 1)))
  else:
    decay = optax.constant_schedule(peak)
  if warmup == 0:
    return decay
  return optax.join_schedules([ramp, decay], [warmup])


def make_optimizer(config: ml_collections.ConfigDict, decay_mask
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
