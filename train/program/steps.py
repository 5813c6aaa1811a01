"""The train and eval steps: pure functions of (state, batch, rng).

Batches are those of `train.data.pipeline`; the task (train/data/tasks.py) says
how a batch feeds the model. Metrics are sums over the
batch (divided by their weight only when summarised), so that micro-batches,
devices and eval batches add up exactly.
"""

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from model.readout import Readout
from train.data.tasks import Task
from train.program import cross_entropy

Array = jax.Array

# Name scopes of the train step's parts, which a profile reads back from
# the compiled program's op names (experiments/profile.py): the readout's
# logits and the loss over them; the gradient's normalisation, the
# optimizer update and the update's checks.
LOSS_SCOPE = 'loss'
OPTIMIZER_SCOPE = 'optimizer'


@flax.struct.dataclass
class TrainState:
  """Everything a step changes: the step count, parameters, optimizer state,
  and a Transformer-XL model's memory of the segments before (else None)."""

  step: Array
  params: Any
  opt_state: Any
  memory: Any = None


def init_params(model: nn.Module, task: Task, rng: Array, seq_len: int, *,
                boxed: bool = False):
  """Freshly initialised parameters, unboxed from their logical axis names
  unless `boxed` (nn.Partitioned leaves, which say how to shard them).
  One compiled program (inside a caller's jit, part of its): called
  eagerly, `init` would compile each of its operations on its own."""
  row = jnp.zeros((1, seq_len), jnp.int32)
  shapes_only = {'inputs': row, 'positions': row, 'decoder_inputs': row}
  params = jax.jit(lambda rng: model.init(
      rng, *task.model_args(shapes_only))['params'])(rng)
  return params if boxed else nn.meta.unbox(params)


def forward(model: nn.Module, task: Task, params, batch: dict[str, Array], *,
            dropout_rng: Array | None = None, memory=None):
  """(model output, memory after it, mixture-of-experts statistics) for
  `batch`: the memory is that of a Transformer-XL language model, None
  otherwise; the statistics (see `_moe_statistics`) None without experts.
  Dropout is on when `dropout_rng` is given."""
  deterministic = dropout_rng is None
  kwargs = dict(deterministic=deterministic,
                rngs={} if deterministic else {'dropout': dropout_rng})
  if memory is not None:
    kwargs['memory'] = memory
  experts = bool(model.config.moe.num_experts)
  if task.vocabulary_logits:  # Read out a block of tokens at a time.
    kwargs['readout'] = True
  result = model.apply({'params': params}, *task.model_args(batch),
                       mutable=['moe'] if experts else False, **kwargs)
  statistics = None
  if experts:
    result, sown = result
    statistics = _moe_statistics(sown['moe'])
  out, memory = result
  return out, memory, statistics


def _moe_statistics(sown) -> dict[str, Array]:
  """The MoE layers' load-balancing loss (their mean), and the token
  choices they dropped and made (sums). A scanned stack's layers sow one
  value each along a leading axis."""
  values: dict[str, list[Array]] = {}
  for path, value in flax.traverse_util.flatten_dict(sown).items():
    values.setdefault(path[-1], []).extend(jnp.ravel(v) for v in value)
  return {'aux_loss': jnp.mean(jnp.concatenate(values['aux_loss'])),
          'dropped': jnp.sum(jnp.concatenate(values['dropped'])),
          'assigned': jnp.sum(jnp.concatenate(values['assigned']))}


def metric_sums(out: Array | Readout, batch: dict[str, Array], *,
                label_smoothing: float = 0.0, z_loss: float = 0.0,
                exact_match: bool = False) -> dict[str, Array]:
  """Weighted sums: loss (nats), plain nll, correct predictions, weight,
  of the model's output: logits [..., V] or a language model's `Readout`
  (its logits computed a block of tokens at a time; then only the loss
  sum carries a gradient).

  With `exact_match`, also the number of examples and of examples whose
  every weighted target is predicted (teacher-forced exact match, which is
  also the exact match of greedy decoding: with every prediction right, the
  decoder is always fed the true prefix).
  """
  targets, weights = batch['targets'], batch['weights']
  if isinstance(out, Readout):
    loss_sum, losses = cross_entropy.readout_loss_sum(
        out, targets, weights, label_smoothing, z_loss)
  else:
    losses = cross_entropy.token_losses(out, targets, label_smoothing,
                                        z_loss)
    loss_sum = jnp.sum(losses.loss * weights)
  sums = {'loss_sum': loss_sum,
          'nll_sum': jnp.sum(losses.nll * weights),
          'correct_sum': jnp.sum(losses.correct * weights),
          'weight_sum': jnp.sum(weights)}
  if exact_match:
    has_targets = jnp.any(weights > 0, axis=-1)
    all_correct = jnp.all((losses.correct > 0) | (weights == 0), axis=-1)
    sums['example_count'] = jnp.sum(has_targets.astype(jnp.float32))
    sums['exact_match_sum'] = jnp.sum((has_targets & all_correct).astype(
        jnp.float32))
  return sums


def _micro_batches(batch: dict[str, Array], count: int) -> dict[str, Array]:
  """[B, ...] -> [count, B / count, ...]; micro-batch j takes rows j, j +
  count, ..., so that each device's rows split evenly and stay put."""
  return jax.tree.map(
      lambda x: jnp.swapaxes(x.reshape(x.shape[0] // count, count,
                                       *x.shape[1:]), 0, 1), batch)


def train_step(state: TrainState, batch: dict[str, Array], rng: Array, *,
               model: nn.Module, task: Task,
               optimizer: optax.GradientTransformation,
               learning_rates: dict[str, optax.Schedule],
               label_smoothing: float = 0.0,
               z_loss: float = 0.0, grad_accum_steps: int = 1,
               skip_nonfinite: bool = False,
               device_axes: tuple[str, ...] | None = None
               ) -> tuple[TrainState, dict]:
  """One optimizer update on `batch`, accumulated over micro-batches.

  With `skip_nonfinite`, an update whose loss or gradient is not finite is
  dropped: the parameters and optimizer state stay as they were, the step
  count still advances (the batch is consumed), the metric sums are zeroed
  and `skipped` is 1.

  The metrics hold each of `learning_rates` (make_optimizer's, by name) at
  this step. Dropout draws from `fold_in(rng, step)`, so a resumed run
  draws the same.
  A Transformer-XL memory (state.memory) is read and replaced; it needs the
  whole batch at once (grad_accum_steps == 1).

  `device_axes` names the mesh axes when this runs on every device on its
  own part of the batch (inside `jax.shard_map`, the pmap strategy): each
  device takes the gradient of its own examples' loss, and an explicit
  `psum` over those axes adds the gradients and metric sums of all devices
  before the (replicated) update.
  """
  if state.memory is not None and grad_accum_steps != 1:
    raise ValueError('a Transformer-XL memory needs grad_accum_steps == 1.')
  step_rng = jax.random.fold_in(rng, state.step)

  def micro_step(carry, micro):
    grad_sum, memory = carry
    index, micro_batch = micro

    def loss_fn(params):
      out, new_memory, experts = forward(
          model, task, params, micro_batch, memory=memory,
          dropout_rng=jax.random.fold_in(step_rng, index))
      with jax.named_scope(LOSS_SCOPE):
        sums = metric_sums(out, micro_batch,
                           label_smoothing=label_smoothing, z_loss=z_loss)
      loss = sums['loss_sum']
      if experts is not None:
        # Weighted like the loss, so that its mean over the batch is
        # aux_loss_weight times the load-balancing loss.
        aux_sum = experts['aux_loss'] * sums['weight_sum']
        loss += model.config.moe.aux_loss_weight * aux_sum
        sums |= {'moe_aux_loss_sum': aux_sum,
                 'moe_dropped': experts['dropped'],
                 'moe_assigned': experts['assigned']}
      return loss, (sums, new_memory)

    grads, (sums, memory) = jax.grad(loss_fn, has_aux=True)(params)
    return (jax.tree.map(jnp.add, grad_sum, grads), memory), sums

  params = state.params
  if device_axes is not None:
    # Marked per-device, the parameters get this device's gradient; left
    # replicated, shard_map would sum the gradients over the devices itself.
    params = jax.lax.pcast(params, device_axes, to='varying')
  zeros = jax.tree.map(jnp.zeros_like, params)
  (grad_sum, memory), sums = jax.lax.scan(
      micro_step, (zeros, state.memory),
      (jnp.arange(grad_accum_steps), _micro_batches(batch, grad_accum_steps)))
  sums = jax.tree.map(jnp.sum, sums)
  sums['token_count'] = task.token_count(batch)
  if device_axes is not None:
    # Sums, not means: devices whose examples hold more targets weigh more.
    grad_sum, sums = jax.lax.psum((grad_sum, sums), device_axes)
  with jax.named_scope(OPTIMIZER_SCOPE):
    return _update(state, grad_sum, sums, memory, optimizer=optimizer,
                   learning_rates=learning_rates,
                   skip_nonfinite=skip_nonfinite)


def _update(state: TrainState, grad_sum, sums: dict[str, Array], memory, *,
            optimizer: optax.GradientTransformation,
            learning_rates: dict[str, optax.Schedule], skip_nonfinite: bool
            ) -> tuple[TrainState, dict]:
  """`train_step`'s update of `state` by the summed gradient of the batch's
  loss, and its metrics (see `train_step`)."""
  # The loss is the mean over every weighted target of the whole batch.
  grads = jax.tree.map(lambda g: g / jnp.maximum(sums['weight_sum'], 1.0),
                       grad_sum)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  new_state = TrainState(step=state.step + 1,
                         params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state, memory=memory)
  metrics = dict(sums, grad_norm=optax.tree.norm(grads),
                 **{name: rate(state.step)
                    for name, rate in learning_rates.items()})
  if skip_nonfinite:
    finite = jnp.isfinite(sums['loss_sum']) & jnp.isfinite(
        metrics['grad_norm'])

    def keep(new, old):
      return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

    new_state = new_state.replace(
        params=keep(new_state.params, state.params),
        opt_state=keep(new_state.opt_state, state.opt_state),
        memory=keep(new_state.memory, state.memory))
    metrics.update(keep(sums, jax.tree.map(jnp.zeros_like, sums)),
                   skipped=1.0 - finite.astype(jnp.float32))
  return new_state, metrics


def train_steps(state: TrainState, batches: dict[str, Array], rng: Array,
                **kwargs) -> tuple[TrainState, dict]:
  """`train_step` on each of K batches (`batches`: [K, B, ...]) in turn, in
  one program: the same dropout keys (drawn by state.step), schedule
  values, skipped updates, mixture-of-experts statistics and memory carry
  as K calls; the metric sums of each step stacked [K]."""
  return jax.lax.scan(
      lambda state, batch: train_step(state, batch, rng, **kwargs),
      state, batches)


def eval_step(params, batch: dict[str, Array], memory=None, *,
              model: nn.Module, task: Task) -> tuple[dict[str, Array], Any]:
  """Metric sums of `batch` without dropout, label smoothing or z-loss, and
  the Transformer-XL memory after it (None without one)."""
  out, memory, _ = forward(model, task, params, batch, memory=memory)
  return metric_sums(out, batch, exact_match=task.exact_match), memory
