"""Checks a training config before anything is built or compiled: each key
by its rule (train/base/train_config.py), `config.model` by ModelConfig,
then what the keys ask of each other, of the dataset's task, of the
model's attention and (train/config/layout.py) of the mesh. A config that
passes becomes a TrainConfig, which everything after reads.

Each rule names the key it checks, so a mistake is reported as, e.g.,
`config.model.num_heads=6 does not split over config.parallelism.tensor=4`.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from model import ModelConfig, attention, families
from model.attention import options as variant_options
from model.attention.kernels import fused
from model.config import occurrence_values
from model.positions import SCHEMES
from train.base import hosts, train_config
from train.base.errors import InputError, did_you_mean
from train.base.train_config import TrainConfig
from train.config import kernels, layout as layout_validation
from train.data import datasets
from train.data.tasks import Task
from train.decode import decoding
from train.program import device_memory, mesh as mesh_lib, optim, windows


def _fail(message: str):
  raise InputError(message)


@dataclasses.dataclass(frozen=True)
class Checked:
  """A config that passed, and what checking it found out on the way."""

  config: TrainConfig
  task: Task
  mesh: jax.sharding.Mesh
  # The parameters' shapes and logical names (nn.Partitioned leaves of
  # jax.ShapeDtypeStruct), for their layout on the mesh.
  param_shapes: Any
  # The choice of each fused-kernel call of a training step, in call order
  # (train/config/kernels.py).
  kernels: tuple[fused.Decision, ...]


def validate(config: ml_collections.ConfigDict) -> TrainConfig:
  """The TrainConfig of a config that `check` passes."""
  return check(config).config


def check(config: ml_collections.ConfigDict, devices=None) -> Checked:
  """Raises InputError naming every bad key, one line each. Rules that
  need a sound model (its kernels, its layout on a mesh of `devices`,
  default every device of every host) run once the others pass."""
  problems = []

  def collect(rule, *args):
    try:
      return rule(*args)
    except InputError as error:
      problems.append(str(error))

  problems += train_config.problems(
      config, {'schedule': train_config.one_of(optim.SCHEDULES),
               'optimizer': train_config.one_of(optim.OPTIMIZERS)})
  if 'model' not in config or 'dataset' not in config:
    raise InputError('\n'.join(problems))
  task = collect(datasets.task_of, config.dataset)
  model_config = collect(_model_config, config)
  if task is None or model_config is None:
    raise InputError('\n'.join(problems))
  # Each option's key is named as it was typed (flat, or by attention).
  key_of = functools.partial(variant_options.option_key, model_config,
                             config.model.get('attention_options', {}))
  config = TrainConfig.from_config(config, model_config)
  problems += _attention_problems(config, task, key_of)
  problems += _kernel_option_problems(config, key_of)
  if model_config.memory_length and (config.pack_sequences
                                     or config.grad_accum_steps != 1):
    problems.append(
        f'config.model.memory_length={model_config.memory_length} reads '
        'contiguous streams of whole batches: set config.pack_sequences='
        'False and config.grad_accum_steps=1.')
  trainers = families.trainers(task.name)
  if model_config.family not in trainers:
    problems.append(
        f'config.model.family={model_config.family!r} cannot train on '
        f'config.dataset={config.dataset!r} ({task.name}); use '
        + ' or '.join(map(repr, trainers)) + '.')
  collect(_check_decode_splits, config, task)
  problems += _interval_problems(config)
  problems += filter(None, [windows.problem(config)])
  if config.track_corpus and config.dataset not in datasets.FILE_CORPORA:
    problems.append(
        f'config.track_corpus={config.track_corpus!r} names the fingerprint '
        f'of a corpus ({" and ".join(datasets.FILE_CORPORA)}); config.'
        f'dataset={config.dataset!r} has none.')
  if problems:
    raise InputError('\n'.join(problems))
  positions = model_positions(config)
  limit = SCHEMES[model_config.position].max_positions(model_config)
  if limit is not None and positions > limit:
    problems.append(
        f'config.seq_len={config.seq_len} needs {positions} positions, more '
        f'than config.model.max_len={limit}.')
  mesh = collect(mesh_lib.make_mesh, config.parallelism, devices)
  if not problems:
    collect(layout_validation.check_splits, config, mesh, positions)
  if not problems:  # Before tracing, which a long length makes slow.
    collect(check_step_bound, config, task, mesh.size, positions)
  traced = None
  if not problems:
    traced = collect(layout_validation.trace_model, config, task, mesh)
  if traced:
    problems += kernels.refusals(config, traced.kernels, key_of)
  if not problems:
    collect(layout_validation.check_parameters, config, mesh,
            traced.param_shapes)
  if not problems:
    collect(check_step_bound, config, task, mesh.size, positions,
            traced.param_shapes)
  if problems:
    raise InputError('\n'.join(problems))
  return Checked(config, task, mesh, traced.param_shapes, traced.kernels)


def _model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  unknown = _unknown_names(config.model)
  if unknown:
    raise InputError('\n'.join(unknown))
  try:
    model_config = ModelConfig.from_mapping(config.model)
    families.check(model_config)
    return model_config
  except ValueError as error:
    raise InputError(str(error)) from None


def _unknown_names(model: ml_collections.ConfigDict) -> list[str]:
  """Each attention and position scheme `model` names that is not
  registered, with the nearest registered name."""
  pattern = model.get('attention', ModelConfig.attention)
  entries = occurrence_values(pattern)
  keys = ([f'model.attention[{index}]' for index in range(len(entries))]
          if entries else ['model.attention'])
  registered = train_config.one_of(['auto'] + attention.names())
  found = [registered(key, name)
           for key, name in zip(keys, entries or (pattern,))]
  found.append(train_config.one_of(list(SCHEMES))(
      'model.position', model.get('position', ModelConfig.position)))
  return [problem for problem in found if problem]


def _attention_problems(config: TrainConfig, task: Task,
                        key_of: kernels.KeyOf) -> list[str]:
  """Each attention of the pattern (or the one) against its options and
  the packed rows a language model reads; the closing sample."""
  model_config = config.model
  problems = []
  for layer_config in model_config.layer_configs():
    known = sorted(variant_options.option_names(layer_config.attention))
    for name, _ in layer_config.attention_options:
      if name not in known:
        problems.append(
            f'unknown key {key_of(layer_config.attention, name)} for '
            f'config.model.attention={layer_config.attention!r}; it takes '
            f'{known}{did_you_mean(name, known)}')
    variant = attention.spec(layer_config.attention)
    if task.packs and config.pack_sequences and not variant.packs:
      problems.append(
          f'config.model.attention={layer_config.attention!r} cannot keep '
          'packed sequences apart (it takes key padding masks only); set '
          'config.pack_sequences=False.')
  refusal = decoding.cache_refusal(model_config)
  if task.continues_text and config.sample_length and refusal:
    problems.append(
        f'config.sample_length={config.sample_length} samples with a '
        f'cache, and {refusal}; set it to 0.')
  return list(dict.fromkeys(problems))  # A pattern repeats its layers.


def _interval_problems(config: TrainConfig) -> list[str]:
  """The logging, evaluation and checkpoint intervals fall on the last
  step of a call (config.steps_per_call)."""
  per_call, problems = config.steps_per_call, []
  for key in ('log_every', 'eval_every', 'checkpoint_every'):
    every = getattr(config, key)
    if every % per_call:
      nearest = [value for value in (every // per_call * per_call,
                                     (every // per_call + 1) * per_call)
                 if value > 0]
      problems.append(
          f'config.{key}={every} must be a multiple of config.'
          f'steps_per_call={per_call}: {" or ".join(map(str, nearest))}.')
  return problems


def _kernel_option_problems(config: TrainConfig,
                            key_of: kernels.KeyOf) -> list[str]:
  """A kernel option of a layer's attention names one of fused.KERNELS
  (whether that kernel computes the layer is learnt by tracing)."""
  problems = []
  for layer_config in config.model.layer_configs():
    kernel = dict(layer_config.attention_options).get('kernel', 'auto')
    if kernel not in fused.KERNELS:
      problems.append(
          f'{key_of(layer_config.attention, "kernel")}={kernel!r} must be '
          f'one of {list(fused.KERNELS)}{did_you_mean(kernel, fused.KERNELS)}')
  return list(dict.fromkeys(problems))


def _check_decode_splits(config: TrainConfig, task: Task) -> None:
  """Decoding at each evaluation: split names, of a sequence-to-sequence
  dataset, with attentions that decode with a cache."""
  splits = config.decode_splits
  if not splits:
    return
  if not task.decodes:
    _fail(f'config.decode_splits={tuple(splits)!r}: decoding evaluates '
          f'sequence-to-sequence datasets, and config.dataset='
          f'{config.dataset!r} is {task.name}; set it to ().')
  refusal = decoding.cache_refusal(config.model)
  if refusal:
    _fail(f'config.decode_splits={tuple(splits)!r} decodes with a cache, '
          f'and {refusal}.')


def warnings_of(config: TrainConfig) -> list[str]:
  """One line for each setting of a valid config that is likely not what
  was meant; the trainer prints them at start."""
  found = []
  steps, warmup = config.num_train_steps, config.warmup_steps
  peak = f'config.learning_rate={config.learning_rate:.3g}'
  cooldown = optim.wsd_cooldown_steps(config)
  # Under wsd, the warmup's ramp meets the cooldown's line unless it is
  # below the final rate at num_train_steps.
  meets = steps > warmup * config.final_learning_rate_fraction
  if config.schedule == 'wsd' and warmup + cooldown > steps and meets:
    rates = optim.learning_rate_schedule(config)(
        jnp.arange(steps + 1)) / config.learning_rate
    found.append(
        f'config.warmup_steps={warmup} and the wsd cooldown of {cooldown} '
        f'step{"s" * (cooldown > 1)} (config.decay_fraction='
        f'{config.decay_fraction} of config.num_train_steps={steps}) '
        'overlap: the learning rate rises on the warmup until it meets the '
        f'cooldown, reaching at most {float(rates.max()):.3g} of {peak}, '
        f'and ends at {float(rates[-1]):.3g} of it.')
  elif warmup > steps:
    found.append(
        f'config.warmup_steps={warmup} exceeds config.num_train_steps='
        f'{steps}: the learning rate never leaves its warmup, reaching '
        f'{steps / warmup:.3g} of {peak}.')
  defaults = train_config.defaults()
  for key, readers in optim.optimizer_keys().items():
    value = getattr(config, key)
    if config.optimizer not in readers and value != defaults[key]:
      found.append(
          f'config.{key}={value} has no effect: config.optimizer='
          f'{config.optimizer!r} does not read it ({" and ".join(readers)} '
          f'do{"es" * (len(readers) == 1)}).')
  model = config.model
  if model.value_residual and model.num_layers < 2:
    found.append(
        'config.model.value_residual=True has no effect: config.model.'
        f'num_layers={model.num_layers} has no layer after the first to mix '
        "the first layer's values into.")
  return found


def model_positions(config: TrainConfig) -> int:
  """The length of the model's activations: config.seq_len, plus what the
  family adds (a classifier's CLS vector)."""
  family = families.FAMILIES[config.model.family]
  return config.seq_len + family.extra_positions(config.model)


def check_dataset_fits(config: TrainConfig, dataset: datasets.Dataset,
                       vocabulary: str = 'config.model.vocab_size') -> None:
  """The dataset has the eval and decode splits, and the model's
  vocabulary and classes cover the dataset's. `vocabulary`: what the
  user set the vocabulary by, as the error names it (an import: the
  checkpoint's vocab_size)."""
  if config.eval_split not in dataset.splits:
    _fail(f'config.eval_split={config.eval_split!r} is not a split of '
          f'config.dataset={config.dataset!r}; it has {sorted(dataset.splits)}.')
  if dataset.vocab_size > config.model.vocab_size:
    _fail(f'{vocabulary}={config.model.vocab_size} is smaller than the '
          f'{dataset.vocab_size} token ids of config.dataset='
          f'{config.dataset!r}'
          + (f' tokenized by config.tokenizer={config.tokenizer!r}.'
             if config.tokenizer else '.'))
  if dataset.task.has_classes and (
      config.model.num_classes != dataset.num_classes):
    _fail(f'config.model.num_classes={config.model.num_classes} must equal '
          f'the {dataset.num_classes} classes of config.dataset='
          f'{config.dataset!r}.')
  for split in config.decode_splits:
    if split not in dataset.splits:
      _fail(f'config.decode_splits names {split!r}, which is not a split of '
            f'config.dataset={config.dataset!r}; it has '
            f'{sorted(dataset.splits)}.')
  if config.sample_length and dataset.task.continues_text:
    prompt = dataset.tokenizer.encode(config.sample_prompt)
    if len(prompt) + 1 >= config.seq_len:
      _fail(f'config.sample_prompt is {len(prompt)} tokens; it must be '
            f'shorter than config.seq_len={config.seq_len} - 1.')


def device_bytes() -> int:
  """The memory one local device holds; on a CPU, the host's memory shared
  by its devices."""
  return device_memory.held_bytes(host_share=1 / len(jax.local_devices()))


def _size(count: float) -> str:
  return (f'{count / 2**30:,.1f} GiB' if count >= 2**30
          else f'{count / 2**20:,.1f} MiB')


def check_step_fits(compiled: jax.stages.Compiled,
                    config: TrainConfig) -> None:
  """Before the first step: the compiled train step's memory on a device
  (its arguments, outputs and temporaries, less what it updates in place)
  fits in what the device holds; InputError with the figures and the keys
  that set them otherwise."""
  memory = compiled.memory_analysis()
  held = hosts.minimum_over_hosts(device_bytes())  # Every host alike.
  if memory is None:
    return
  needed = device_memory.needed_bytes(memory)
  if needed > held:
    _fail(_too_big(config, _size(needed), held))


def check_step_bound(config: TrainConfig, task: Task, devices: int,
                     positions: int, param_shapes=None) -> None:
  """Before compiling (and before tracing, without `param_shapes`): what
  a train step holds at least (device_memory.least_step_bytes, with the
  parameters once `param_shapes` gives them) fits in what each device
  holds; InputError with the figures and the keys that set them
  otherwise."""
  params = sum(leaf.size for leaf in jax.tree.leaves(param_shapes))
  parts = device_memory.least_step_bytes(config, task, positions, devices,
                                         params)
  held = hosts.minimum_over_hosts(device_bytes())  # Every host alike.
  if sum(parts.values()) > held:
    kinds = ', '.join(f'{kind} {_size(size)}' for kind, size in parts.items())
    _fail(_too_big(config, f'at least {_size(sum(parts.values()))}', held)
          .removesuffix('.') + f'; counted before compiling: {kinds}.')


def _too_big(config: TrainConfig, needed: str, held: int) -> str:
  """The refusal of a train step that needs `needed` on each device."""
  model = config.model
  return (f'a train step needs {needed} on each device, which holds '
          f'{_size(held)}: lower config.batch_size={config.batch_size} or '
          f'config.seq_len={config.seq_len}, or the model (config.model.'
          f'd_model={model.d_model}, num_layers={model.num_layers}, '
          f'mlp_dim={model.mlp_dim}), or raise config.grad_accum_steps='
          f'{config.grad_accum_steps}.')
