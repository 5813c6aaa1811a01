"""Attention transfer: a model whose attention replaced another's (a
student started by config.init_from from a teacher with another
config.model.attention) learns to give, layer by layer, the teacher's
attention outputs on the same inputs, by their mean squared error: the
first stage of LoLCATs (Zhang et al. 2025). Hedgehog (Zhang et al. 2024)
teaches its feature maps otherwise, matching softmax attention's weights
by their cross-entropy.

In one step both models read the same batch: the teacher's forward pass
records each self-attention layer's inputs and output; in the student's,
each self-attention layer reads the teacher's inputs of that layer and
hands the teacher's output on, so every layer is taught apart from the
others' errors. The loss is the mean over layers of each layer's mean
squared error. Only the parameters named trainable move (Adam); the
teacher and the rest of the student are frozen.
"""

from collections.abc import Callable, Iterable, Iterator
import functools
from typing import Any

import flax
import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import optax

from model.layers import is_self_attention_call
from train.run.program import Program


def check_unscanned(*programs: Program) -> None:
  """ValueError unless every program's layers run one by one: a scanned
  stack calls its layers inside a loop, where no call can be recorded."""
  for program in programs:
    if program.model_config.scan_layers:
      raise ValueError('attention transfer reads each layer\'s calls: set '
                       'config.model.scan_layers=False.')


def layer_errors(teacher: Program, student: Program, teacher_params: Any,
                 student_params: Any, batch: dict) -> jax.Array:
  """[layers] mean squared error of each student self-attention layer's
  output against the teacher's, both reading the teacher's inputs of that
  layer (traceable; both models unscanned, see check_unscanned)."""
  args = teacher.task.model_args(batch)
  recorded = {}

  def record(next_fun, call_args, kwargs, context):
    out = next_fun(*call_args, **kwargs)
    if is_self_attention_call(context):
      if context.module.path in recorded:
        raise ValueError(f'the layer {"/".join(context.module.path)} is '
                         'called twice in a forward pass.')
      recorded[context.module.path] = (call_args, kwargs, out)
    return out

  with nn.intercept_methods(record):
    teacher.model.apply({'params': teacher_params}, *args)
  errors = []

  def replay(next_fun, call_args, kwargs, context):
    if not is_self_attention_call(context):
      return next_fun(*call_args, **kwargs)
    taught_args, taught_kwargs, taught = recorded[context.module.path]
    out = next_fun(*taught_args, **taught_kwargs)
    target = jax.lax.stop_gradient(taught[0]).astype(jnp.float32)
    errors.append(jnp.mean(jnp.square(out[0].astype(jnp.float32) - target)))
    return taught

  with nn.intercept_methods(replay):
    student.model.apply({'params': student_params}, *args)
  return jnp.stack(errors)


def _split(params: Any, trainable: Iterable[str]) -> tuple[dict, dict]:
  """({path: leaf} of the `trainable` paths, of the others)."""
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params), sep='/')
  names = set(trainable)
  return ({path: leaf for path, leaf in flat.items() if path in names},
          {path: leaf for path, leaf in flat.items() if path not in names})


def _joined(trained: dict, frozen: dict) -> Any:
  return traverse_util.unflatten_dict(trained | frozen, sep='/')


def transfer(teacher: Program, student: Program, teacher_params: Any,
             student_params: Any, trainable: Iterable[str],
             batches: Iterator[dict], *, steps: int, learning_rate: float,
             on_step: Callable[[int, float], None] | None = None) -> Any:
  """The student's parameters after `steps` steps of Adam at
  `learning_rate` on the `trainable` paths ('decoder/block_0/...', none
  of a scanned stack), each step on the next of `batches` (host batches);
  `on_step(step, loss)` after each."""
  check_unscanned(teacher, student)
  trained, frozen = _split(student_params, trainable)
  optimizer = optax.adam(learning_rate)

  # Every array an argument (none a constant of the compiled step); the
  # trained ones and Adam's state are updated in place.
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(trained, opt_state, frozen, teacher_params, batch):
    def loss(trained):
      return jnp.mean(layer_errors(teacher, student, teacher_params,
                                   _joined(trained, frozen), batch))
    value, grads = jax.value_and_grad(loss)(trained)
    updates, opt_state = optimizer.update(grads, opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state, value

  # Copies: the caller's parameters are not donated.
  trained = jax.tree.map(jnp.copy, trained)
  opt_state = optimizer.init(trained)
  with student.scope():
    for number in range(1, steps + 1):
      trained, opt_state, value = step(trained, opt_state, frozen,
                                       teacher_params,
                                       student.batch(next(batches)))
      if on_step:
        on_step(number, float(value))
  return _joined(trained, frozen)
