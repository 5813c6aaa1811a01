"""The pure train/eval steps."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model import ModelConfig, build
from tests.helpers.tiny_runs import tiny_config
from train.data import tasks
from train.program import steps
from train.run.program import Program


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
                            learning_rates={},
                            grad_accum_steps=accumulate)

  (one, one_metrics), (two, two_metrics) = run(1), run(2)
  chex.assert_trees_all_close(one.params, two.params, atol=1e-6, rtol=1e-7)
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
                                  optimizer=optimizer, learning_rates={})
    return float(metrics['loss_sum'])

  assert loss_at(3) == loss_at(3)
  assert loss_at(3) != loss_at(4)


def lowered_train_step(data_dir) -> str:
  """The program of a tiny LM's train step, as lowered (a new Program, so
  that it is traced again)."""
  program = Program.from_config(tiny_config('lm_stdlib', data_dir))
  batch = program.batch(program.task.synthetic_batch(program.config))
  with program.scope():
    return program.train_step.trace(program.abstract_state, batch,
                                    program.key(1)).lower().as_text()


def test_the_checks_of_shapes_add_nothing_to_the_program(data_dir):
  """chex's checks of the attention functions' and the model's inputs run
  as they are traced: the train step is the same program without them."""
  checked = lowered_train_step(data_dir)
  chex.disable_asserts()
  try:
    unchecked = lowered_train_step(data_dir)
  finally:
    chex.enable_asserts()
  assert checked == unchecked
