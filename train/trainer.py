"""train_and_evaluate: the training loop, composed from the config.

Data parallel over every device: the state is replicated, each batch is
split along its first dim over a one-axis mesh ('data').
"""

import functools
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from model import build, families
from train import checkpointing, config_validation, metrics, optim, sampling
from train import steps
from train.data import datasets, pipeline, tokenizers
from train.errors import InputError


def _say(message: str) -> None:
  """A status line on the terminal, from the first host only."""
  if jax.process_index() == 0:
    print(message, flush=True)


def _write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  if jax.process_index() == 0:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True) + '\n')


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, float]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint.

  Returns the final evaluation summary (eval_loss, eval_accuracy, ...).
  Raises train.errors.InputError, naming the key, for a bad config.
  """
  model_config = config_validation.validate(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  _write_config(config, workdir)
  dataset = datasets.load(config, workdir)
  config_validation.check_dataset_fits(config, dataset)

  model = build(model_config)
  optimizer, schedule = optim.make_optimizer(config)
  layout = ('streams' if model_config.memory_length else
            'packed' if config.pack_sequences else 'padded')
  init_rng, dropout_rng, sample_rng = jax.random.split(
      jax.random.key(config.seed), 3)
  per_host_batch = config.batch_size // jax.process_count()

  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  replicated = NamedSharding(mesh, PartitionSpec())
  batch_sharding = NamedSharding(mesh, PartitionSpec('data'))

  def empty_memory():
    """A Transformer-XL memory of nothing yet, or None without one."""
    if not model_config.memory_length:
      return None
    return families.empty_memory(model_config, config.batch_size)

  def init_state(rng):
    params = steps.init_params(model, dataset.kind, rng, config.seq_len)
    return steps.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                            opt_state=optimizer.init(params),
                            memory=empty_memory())

  abstract_state = jax.eval_shape(init_state, init_rng)
  state_sharding = jax.tree.map(lambda _: replicated, abstract_state)
  # A memory is per example: split over the devices like the batch.
  memory_sharding = {'hidden': NamedSharding(mesh, PartitionSpec(None, 'data')),
                     'valid': batch_sharding} if layout == 'streams' else None
  state_sharding = state_sharding.replace(memory=memory_sharding)
  train_step = jax.jit(
      functools.partial(steps.train_step, model=model, kind=dataset.kind,
                        optimizer=optimizer, schedule=schedule,
                        label_smoothing=config.label_smoothing,
                        grad_accum_steps=config.grad_accum_steps),
      in_shardings=(state_sharding, batch_sharding, replicated),
      out_shardings=(state_sharding, replicated), donate_argnums=0)
  eval_step = jax.jit(
      functools.partial(steps.eval_step, model=model, kind=dataset.kind),
      in_shardings=(state_sharding.params, batch_sharding, memory_sharding),
      out_shardings=(replicated, memory_sharding))

  def global_batch(batch):
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(batch_sharding, x),
        batch)

  fresh_memory = jax.jit(empty_memory, out_shardings=memory_sharding)

  def evaluate(params) -> dict[str, float]:
    totals, memory = None, fresh_memory()
    for batch in pipeline.eval_batches(
        dataset, config.eval_split, seq_len=config.seq_len,
        batch_size=per_host_batch, num_batches=config.num_eval_steps,
        layout=layout):
      sums, memory = eval_step(params, global_batch(batch), memory)
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    if totals is None:
      raise InputError(
          f'config.eval_split={config.eval_split!r} has no examples of at '
          f'most config.seq_len={config.seq_len} tokens.')
    return metrics.summarize_eval(jax.device_get(totals),
                                  byte_level=dataset.byte_level)

  train_iterator = pipeline.train_iterator(
      dataset, seq_len=config.seq_len, batch_size=per_host_batch,
      seed=config.seed, layout=layout)
  checkpointer = checkpointing.Checkpointer(workdir,
                                            keep=config.keep_checkpoints)
  latest = checkpointer.latest_step()
  if latest is None:
    state = jax.jit(init_state, out_shardings=state_sharding)(init_rng)
  else:
    abstract = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                    sharding=sharding),
        abstract_state, state_sharding)
    state = checkpointer.restore(latest, abstract, train_iterator)
    _say(f'Resumed from the checkpoint at step {latest}.')

  num_params = sum(x.size for x in jax.tree.leaves(abstract_state.params))
  _say(f'{model_config.family} on {config.dataset}: {num_params:,} '
       f'parameters, {jax.device_count()} {jax.default_backend()} devices, '
       f'workdir {workdir}')
  last_step = config.num_train_steps
  first_step = int(state.step)
  writer = metrics.MetricWriter(workdir, total_steps=last_step,
                                first_step=first_step)
  train_log = metrics.TrainLog(writer, config.log_every, last_step)
  final = None
  try:
    for step in range(first_step, last_step):
      state, step_metrics = train_step(
          state, global_batch(next(train_iterator)), dropout_rng)
      done = step + 1
      logged = train_log.add(done, step_metrics)
      if logged:
        writer.write(*logged)
      evaluate_now = metrics.is_due(done, config.eval_every, last_step)
      save_now = metrics.is_due(done, config.checkpoint_every, last_step)
      if evaluate_now or save_now:
        logged = train_log.complete()
        summary = logged[1] if logged else {}
        if evaluate_now:
          final = evaluate(state.params)
          summary |= final
        if summary:
          writer.write(done, summary)
        if save_now:
          checkpointer.save(done, state, train_iterator)
        train_log.restart_clock()
    if final is None:  # Trained to the end before; evaluate again only.
      final = evaluate(state.params)
      _say(f'Already trained to step {last_step}; evaluation: {final}')
  finally:
    train_iterator.close()
    writer.close()
    checkpointer.close()

  if dataset.kind == 'lm' and config.sample_length:
    prompt = np.concatenate([[tokenizers.EOS_ID], dataset.tokenizer.encode(
        config.sample_prompt)])
    tokens = sampling.sample(
        model, state.params, prompt, num_tokens=config.sample_length,
        max_len=config.seq_len, temperature=config.sample_temperature,
        rng=sample_rng)
    print(f'--- sample (temperature {config.sample_temperature}) ---\n'
          f'{dataset.tokenizer.decode(tokens)}\n---')
  return final
