"""Checks a training config before anything is built or compiled.

Each rule names the key it checks, so a mistake is reported as, e.g.,
`config.model.num_heads=6 does not split over config.parallelism.tensor=4`.
"""

import dataclasses
import functools
from typing import Any

import jax
import ml_collections

from model import ModelConfig, attention, attention_parameters
from model.attention import fused
from train import (attention_kernels, device_memory, layout_validation, mesh,
                   metrics, optim)
from train.data import datasets
from train.errors import InputError, did_you_mean
from train.tasks import Task

# The model family that trains on each task.
FAMILY_OF_TASK = {'lm': 'decoder_lm', 'seq2seq': 'encoder_decoder',
                  'classification': 'encoder_classifier'}
# Other families that train on a task.
ALSO_TRAINS = {'seq2seq': ('rnn_attention',)}


def _fail(message: str):
  raise InputError(message)


def _integer(config, key: str, minimum: int) -> int:
  value = config[key]
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    _fail(f'config.{key}={value!r} must be an integer >= {minimum}.')
  return value


def _number(config, key: str, low: float, high: float, *,
            include_low: bool = True, include_high: bool = False) -> float:
  value = config[key]
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  if ok:
    ok = (value >= low if include_low else value > low) and (
        value <= high if include_high else value < high)
  if not ok:
    interval = (('[' if include_low else '(') + f'{low}, {high}'
                + (']' if include_high else ')'))
    _fail(f'config.{key}={value!r} must be a number in {interval}.')
  return value


def _text(config, key: str, *, empty: bool) -> str:
  value = config[key]
  if not isinstance(value, str) or not (empty or value):
    _fail(f'config.{key}={value!r} must be a{"" if empty else " non-empty"} '
          'string.')
  return value


def _choice(config, key: str, choices) -> str:
  if config[key] not in choices:
    _fail(f'config.{key}={config[key]!r} must be one of {list(choices)}'
          f'{did_you_mean(config[key], choices)}')
  return config[key]


@dataclasses.dataclass(frozen=True)
class Checked:
  """What checking a config found out on the way."""

  model_config: ModelConfig
  task: Task
  # The parameters' shapes and logical names (nn.Partitioned leaves of
  # jax.ShapeDtypeStruct), for their layout on the mesh.
  param_shapes: Any


def validate(config: ml_collections.ConfigDict) -> ModelConfig:
  """The ModelConfig of a config that `check` passes."""
  return check(config).model_config


def check(config: ml_collections.ConfigDict) -> Checked:
  """Raises InputError naming every bad key, one line each. Rules that
  need a sound model (its kernels, its layout on the mesh) run once the
  others pass."""
  problems = []

  def check(rule, *args):
    try:
      return rule(*args)
    except InputError as error:
      problems.append(str(error))

  for key in ('seq_len', 'num_train_steps', 'log_every', 'keep_checkpoints',
              'grad_accum_steps', 'sample_length'):
    check(_integer, config, key, 1 if key != 'sample_length' else 0)
  for key in ('warmup_steps', 'eval_every', 'checkpoint_every', 'seed',
              'max_skipped_steps', 'debug_poison_step'):
    check(_integer, config, key, 0)
  if config.num_eval_steps != -1:
    check(_integer, config, 'num_eval_steps', 1)
  check(_integer, config, 'batch_size', 1)
  check(_integer, config, 'beam_size', 1)
  if config.num_decode_examples != -1:
    check(_integer, config, 'num_decode_examples', 1)
  inf = float('inf')
  for key, low, high, options in (
      ('learning_rate', 0.0, inf, {'include_low': False}),
      ('final_learning_rate_fraction', 0.0, 1.0, {'include_high': True}),
      ('weight_decay', 0.0, inf, {}), ('grad_clip_norm', 0.0, inf, {}),
      ('label_smoothing', 0.0, 1.0, {}), ('adam_b1', 0.0, 1.0, {}),
      ('adam_b2', 0.0, 1.0, {}),
      ('adam_eps', 0.0, inf, {'include_low': False}),
      ('sgd_momentum', 0.0, 1.0, {}), ('sample_temperature', 0.0, inf, {}),
      ('beam_alpha', 0.0, inf, {})):
    check(functools.partial(_number, **options), config, key, low, high)
  check(_choice, config, 'schedule', optim.SCHEDULES)
  check(_choice, config, 'optimizer', optim.OPTIMIZERS)
  check(_choice, config, 'nan_policy', metrics.NAN_POLICIES)
  for key in ('data_dir', 'eval_split'):
    check(functools.partial(_text, empty=False), config, key)
  check(functools.partial(_text, empty=True), config, 'sample_prompt')
  if config.vocab_path is not None:
    check(functools.partial(_text, empty=False), config, 'vocab_path')
  if not isinstance(config.pack_sequences, bool):
    problems.append(f'config.pack_sequences={config.pack_sequences!r} must '
                    'be True or False.')
  task = check(datasets.task_of, config.dataset)
  model_config = check(_model_config, config)
  if task is None or model_config is None:
    raise InputError('\n'.join(problems))
  family = FAMILY_OF_TASK[task.name]
  problems += _attention_problems(config, model_config, task)
  if model_config.memory_length and (config.pack_sequences
                                     or config.grad_accum_steps != 1):
    problems.append(
        f'config.model.memory_length={model_config.memory_length} reads '
        'contiguous streams of whole batches: set config.pack_sequences='
        'False and config.grad_accum_steps=1.')
  if model_config.family not in (family,) + ALSO_TRAINS.get(task.name, ()):
    problems.append(
        f'config.model.family={model_config.family!r} cannot train on '
        f'config.dataset={config.dataset!r} ({task.name}); use {family!r}.')
  check(_check_decode_splits, config, model_config, task)
  if problems:
    raise InputError('\n'.join(problems))
  positions = model_positions(config)
  check(_check_kernels, config, model_config, positions)
  if model_config.position == 'learned' and positions > model_config.max_len:
    problems.append(
        f'config.seq_len={config.seq_len} needs {positions} positions, more '
        f'than config.model.max_len={model_config.max_len}.')
  param_shapes = None
  if not problems:
    param_shapes = check(layout_validation.check_layout, config,
                         model_config, task, model_positions(config))
  if problems:
    raise InputError('\n'.join(problems))
  return Checked(model_config, task, param_shapes)


def _model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  try:
    return ModelConfig.from_mapping(config.model)
  except ValueError as error:
    raise InputError(str(error)) from None


def _attention_problems(config: ml_collections.ConfigDict,
                        model_config: ModelConfig, task: Task) -> list[str]:
  """Each attention of the pattern (or the one) against its options, the
  packed rows a language model reads, and its closing sample."""
  problems = []
  for layer_config in model_config.layer_configs():
    known = attention_parameters.option_names(layer_config.attention)
    for name, _ in layer_config.attention_options:
      if name not in known:
        problems.append(
            f'unknown key config.model.attention_options.{name} for config.'
            f'model.attention={layer_config.attention!r}; it takes '
            f'{sorted(known) or "none"}.')
    variant = attention.spec(layer_config.attention)
    if task.packs and config.pack_sequences and variant.masks != 'any':
      problems.append(
          f'config.model.attention={layer_config.attention!r} cannot keep '
          'packed sequences apart (it takes key padding masks only); set '
          'config.pack_sequences=False.')
    if (task.continues_text and config.sample_length
        and not variant.reads_cache):
      problems.append(
          f'config.sample_length={config.sample_length} samples with a '
          'key/value cache, which config.model.attention='
          f'{layer_config.attention!r} cannot read (dense, chunked and '
          'additive can); set it to 0.')
  return list(dict.fromkeys(problems))  # A pattern repeats its layers.


def _check_kernels(config: ml_collections.ConfigDict,
                   model_config: ModelConfig, positions: int) -> None:
  """A kernel named in the attention options exists and computes what the
  model's self-attention asks of it on this backend."""
  for choice in attention_kernels.choices(config, model_config, positions):
    if choice.option not in fused.KERNELS:
      _fail(f'{choice.key}={choice.option!r} must be one of '
            f'{list(fused.KERNELS)}.')
    if choice.refusal:
      _fail(f'{choice.key}={choice.option!r} {choice.refusal}: the '
            f"{choice.stack}'s self-attention is {choice.case.describe()} "
            f"on {choice.case.backend}; set it to 'auto'.")


def _check_decode_splits(config: ml_collections.ConfigDict,
                         model_config: ModelConfig, task: Task) -> None:
  """Decoding at each evaluation: split names, of a sequence-to-sequence
  dataset, with an attention that reads a key/value cache."""
  splits = config.decode_splits
  if not isinstance(splits, (tuple, list)) or not all(
      isinstance(split, str) and split for split in splits):
    _fail(f'config.decode_splits={splits!r} must be a tuple of split names.')
  if not splits:
    return
  if not task.decodes:
    _fail(f'config.decode_splits={tuple(splits)!r}: decoding evaluates '
          f'sequence-to-sequence datasets, and config.dataset='
          f'{config.dataset!r} is {task.name}; set it to ().')
  for layer_config in model_config.layer_configs():
    if not attention.spec(layer_config.attention).reads_cache:
      _fail(f'config.decode_splits={tuple(splits)!r} decodes with a '
            'key/value cache, which config.model.attention='
            f'{layer_config.attention!r} cannot read (dense, chunked and '
            'additive can).')


def warnings_of(config: ml_collections.ConfigDict) -> list[str]:
  """One line for each setting of a valid config that is likely not what
  was meant; the trainer prints them at start."""
  found = []
  if config.warmup_steps > config.num_train_steps:
    reached = (config.learning_rate * config.num_train_steps
               / config.warmup_steps)
    found.append(
        f'config.warmup_steps={config.warmup_steps} exceeds config.'
        f'num_train_steps={config.num_train_steps}: the learning rate never '
        f'leaves its warmup, reaching {reached:.3g} of '
        f'config.learning_rate={config.learning_rate:.3g}.')
  return found


def model_positions(config: ml_collections.ConfigDict) -> int:
  """The length of the model's activations: config.seq_len, plus one for
  a classifier's CLS vector."""
  cls = (FAMILY_OF_TASK[datasets.task_of(config.dataset).name]
         == 'encoder_classifier' and config.model.pooling == 'cls')
  return config.seq_len + int(cls)


def check_dataset_fits(config: ml_collections.ConfigDict,
                       dataset: datasets.Dataset) -> None:
  """The dataset has the eval and decode splits, and the model's
  vocabulary and classes cover the dataset's."""
  if config.eval_split not in dataset.splits:
    _fail(f'config.eval_split={config.eval_split!r} is not a split of '
          f'config.dataset={config.dataset!r}; it has {sorted(dataset.splits)}.')
  if dataset.vocab_size > config.model.vocab_size:
    _fail(f'config.model.vocab_size={config.model.vocab_size} is smaller '
          f'than the {dataset.vocab_size} token ids of config.dataset='
          f'{config.dataset!r}.')
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
                    config: ml_collections.ConfigDict) -> None:
  """Before the first step: the compiled train step's memory on a device
  (its arguments, outputs and temporaries, less what it updates in place)
  fits in what the device holds; InputError with the figures and the keys
  that set them otherwise."""
  memory = compiled.memory_analysis()
  held = mesh.minimum_over_hosts(device_bytes())  # Every host alike.
  if memory is None:
    return
  needed = device_memory.needed_bytes(memory)
  if needed > held:
    model = config.model
    _fail(f'a train step needs {_size(needed)} on each device, which '
          f'holds {_size(held)}: lower config.batch_size='
          f'{config.batch_size} or config.seq_len={config.seq_len}, or the '
          f'model (config.model.d_model={model.d_model}, num_layers='
          f'{model.num_layers}, mlp_dim={model.mlp_dim}), or raise '
          f'config.grad_accum_steps={config.grad_accum_steps}.')
