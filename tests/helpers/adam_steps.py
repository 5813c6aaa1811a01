"""A helper shared by the model tests: a few jitted Adam steps of the
project's own train step on one batch."""

import jax
import jax.numpy as jnp
import optax

from train.program import steps


def adam_steps(model, task, params, batch, count: int,
               learning_rate: float = 1e-2):
  """(state after `count` steps of `steps.train_step` with Adam on `batch`,
  each step's metrics)."""
  optimizer = optax.adam(learning_rate)
  state = steps.TrainState(step=jnp.array(0), params=params,
                           opt_state=optimizer.init(params))
  step = jax.jit(lambda state: steps.train_step(
      state, batch, jax.random.key(1), model=model, task=task,
      optimizer=optimizer, learning_rates={}))
  history = []
  for _ in range(count):
    state, metrics = step(state)
    history.append(metrics)
  return state, history
