"""Optimizer, schedules and the pure train/eval steps."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import lm_stdlib
from model import ModelConfig, build
from train.base.train_config import TrainConfig
from train.data import tasks
from train.program import optim, steps


def _config(**overrides):
  return TrainConfig(**overrides)


@pytest.mark.core
def test_cosine_schedule_warms_up_then_decays_to_the_final_fraction():
  schedule = optim.learning_rate_schedule(_config(
      learning_rate=1.0, warmup_steps=10, num_train_steps=110,
      schedule='cosine', final_learning_rate_fraction=0.1))
  np.testing.assert_allclose([schedule(0), schedule(5), schedule(10)],
                             [0.0, 0.5, 1.0], atol=1e-6)
  np.testing.assert_allclose(schedule(60), 0.1 + 0.9 * 0.5, atol=1e-6)
  np.testing.assert_allclose(schedule(110), 0.1, atol=1e-6)


def test_rsqrt_schedule_is_inverse_square_root_after_warmup():
  schedule = optim.learning_rate_schedule(_config(
      learning_rate=2.0, warmup_steps=100, num_train_steps=10_000,
      schedule='rsqrt'))
  np.testing.assert_allclose(schedule(100), 2.0, rtol=1e-6)
  np.testing.assert_allclose(schedule(400), 2.0 * np.sqrt(100 / 400),
                             rtol=1e-6)


def test_linear_and_constant_schedules():
  config = _config(learning_rate=1.0, warmup_steps=0, num_train_steps=100,
                   final_learning_rate_fraction=0.0)
  config = dataclasses.replace(config, schedule='linear')
  np.testing.assert_allclose(optim.learning_rate_schedule(config)(50), 0.5)
  config = dataclasses.replace(config, schedule='constant')
  np.testing.assert_allclose(optim.learning_rate_schedule(config)(50), 1.0)


@pytest.mark.core
def test_wsd_schedule_holds_the_peak_then_decays_over_the_last_fraction():
  schedule = optim.learning_rate_schedule(_config(
      learning_rate=1.0, warmup_steps=10, num_train_steps=110,
      schedule='wsd', decay_fraction=0.2, final_learning_rate_fraction=0.0))
  np.testing.assert_allclose(
      [schedule(s) for s in (5, 10, 50, 88, 99, 110)],
      [0.5, 1.0, 1.0, 1.0, 0.5, 0.0], atol=1e-6)


def _stdlib_wsd(num_train_steps: int, **overrides):
  """The default experiment's wsd schedule (50 warmup steps, the last 0.2
  of the run decaying to 0.1 of the peak), over a run of that length."""
  config = lm_stdlib.get_config()
  config.update(num_train_steps=num_train_steps, **overrides)
  config = TrainConfig.from_config(config)
  return config, optim.learning_rate_schedule(config)


@pytest.mark.parametrize('num_train_steps, warmup_steps',
                         [(20, 50), (60, 50), (100, 90)])
def test_wsd_too_short_for_its_warmup_and_cooldown_still_ends_at_the_final_rate(
    num_train_steps, warmup_steps):
  config, schedule = _stdlib_wsd(num_train_steps, warmup_steps=warmup_steps)
  assert warmup_steps + optim.wsd_cooldown_steps(config) > num_train_steps
  rates = np.asarray(schedule(jnp.arange(num_train_steps + 1)))
  peak = config.learning_rate
  assert rates[-1] == np.float32(peak * config.final_learning_rate_fraction)
  top = int(rates.argmax())
  assert (np.diff(rates[:top + 1]) >= 0).all()
  assert (np.diff(rates[top:]) <= 0).all()  # Monotone after the warmup.
  ramp = peak * np.arange(num_train_steps + 1) / warmup_steps
  assert (rates <= ramp + 1e-6 * peak).all()  # Never above the warmup's.


@pytest.mark.parametrize('learning_rate', [3.3e-3, 0.03, 0.7])
@pytest.mark.parametrize('num_train_steps, warmup_steps, decay_fraction',
                         [(70, 50, 0.2), (1000, 50, 0.2), (20, 1, 0.1)])
def test_wsd_with_room_for_warmup_and_cooldown_is_the_trapezoid_bitwise(
    learning_rate, num_train_steps, warmup_steps, decay_fraction):
  """Against the trapezoid as optax composes it: warmup, then the peak
  held, then the linear cooldown (whose first value may round above the
  peak)."""
  config, schedule = _stdlib_wsd(
      num_train_steps, learning_rate=learning_rate,
      warmup_steps=warmup_steps, decay_fraction=decay_fraction)
  cooldown = round(decay_fraction * num_train_steps)
  trapezoid = optax.join_schedules(
      [optax.linear_schedule(0.0, learning_rate, warmup_steps),
       optax.join_schedules(
           [optax.constant_schedule(learning_rate),
            optax.linear_schedule(
                learning_rate,
                learning_rate * config.final_learning_rate_fraction,
                cooldown)],
           [num_train_steps - warmup_steps - cooldown])], [warmup_steps])
  counts = jnp.arange(num_train_steps + 2)
  np.testing.assert_array_equal(schedule(counts), trapezoid(counts))


@pytest.mark.core
def test_exact_match_counts_examples_with_every_target_right():
  targets = jnp.array([[2, 3, 1, 0], [2, 3, 1, 0], [0, 0, 0, 0]])
  weights = (targets > 0).astype(jnp.float32)
  predicted = jnp.array([[2, 3, 1, 5], [2, 4, 1, 0], [0, 0, 0, 0]])
  logits = jax.nn.one_hot(predicted, 6) * 10
  sums = steps.metric_sums(logits, {'targets': targets, 'weights': weights},
                           exact_match=True)
  assert float(sums['example_count']) == 2
  assert float(sums['exact_match_sum']) == 1
  assert float(sums['correct_sum']) == 5 and float(sums['weight_sum']) == 6


@pytest.fixture(scope='module')
def lm_setup():
  config = ModelConfig(vocab_size=16, d_model=16, num_heads=2, num_layers=1,
                       mlp_dim=32, max_len=8, dropout_rate=0.1)
  model = build(config)
  rng = np.random.default_rng(0)
  inputs = rng.integers(1, 16, (4, 8)).astype(np.int32)
  batch = {'inputs': inputs, 'targets': np.roll(inputs, -1, axis=1),
           'positions': np.tile(np.arange(8), (4, 1)),
           'segment_ids': np.ones((4, 8), np.int32),
           'weights': np.ones((4, 8), np.float32)}
  batch['weights'][1, 5:] = 0  # Uneven weights across micro-batches.
  params = steps.init_params(model, tasks.LM, jax.random.key(0), 8)
  return model, params, batch


def test_gradient_accumulation_equals_one_big_batch(lm_setup):
  model, params, batch = lm_setup
  # No dropout: micro-batches would draw different masks than one batch.
  model = build(dataclasses.replace(model.config, dropout_rate=0.0))
  optimizer = optax.sgd(0.1)
  state = steps.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=optimizer.init(params))

  def run(accumulate):
    return steps.train_step(state, batch, jax.random.key(0), model=model,
                            task=tasks.LM, optimizer=optimizer,
                            schedule=lambda _: 0.1,
                            grad_accum_steps=accumulate)

  (one, one_metrics), (two, two_metrics) = run(1), run(2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               one.params, two.params)
  np.testing.assert_allclose(one_metrics['loss_sum'], two_metrics['loss_sum'],
                             rtol=1e-5)
  assert int(one.step) == 1


def test_dropout_rng_depends_on_the_step_only(lm_setup):
  model, params, batch = lm_setup
  optimizer = optax.sgd(0.1)

  def loss_at(step):
    state = steps.TrainState(step=jnp.array(step, jnp.int32), params=params,
                             opt_state=optimizer.init(params))
    _, metrics = steps.train_step(state, batch, jax.random.key(0),
                                  model=model, task=tasks.LM,
                                  optimizer=optimizer, schedule=lambda _: 0.1)
    return float(metrics['loss_sum'])

  assert loss_at(3) == loss_at(3)
  assert loss_at(3) != loss_at(4)
