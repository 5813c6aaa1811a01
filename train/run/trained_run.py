"""A training run's workdir, loaded for use: its config, dataset and the
parameters of its latest checkpoint (read alone, without the optimizer's
state), on one device whatever mesh it trained on (generation, translation,
attention maps)."""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import ml_collections

from model import ModelConfig
from train.base import storage, train_config
from train.base.errors import InputError
from train.base.train_config import TrainConfig
from train.data import datasets
from train.decode import decoding
from train.run import checkpointing, portable
from train.run import workdir as workdir_lib
from train.run.program import Program


@dataclasses.dataclass(frozen=True)
class TrainedRun:
  config: TrainConfig
  model: nn.Module
  dataset: datasets.Dataset
  # The latest checkpoint's parameters, and its step.
  params: Any
  step: int

  @property
  def model_config(self) -> ModelConfig:
    return self.config.model


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a run was trained with (as its resumes changed it), set
  for one device (whatever the mesh it trained on: the checkpoint is
  restored into one device's layout), its tokenizer the workdir's, the
  variants it names that files registered registered again
  (train/run/portable.py)."""
  path = storage.path(workdir) / 'config.json'
  if not path.exists():
    raise InputError(f'{path} does not exist: --workdir must be a training '
                     'run\'s workdir.')
  values = portable.readable(workdir, workdir_lib.run_config(workdir))
  # Training keys added since the run was written hold their defaults.
  for key, value in train_config.defaults().to_dict().items():
    values.setdefault(key, value)
  config = ml_collections.ConfigDict(values)
  config.parallelism.update(data=-1, fsdp=1, tensor=1, sequence=1,
                            strategy='pjit', dcn_data=1)
  config.distributed = False
  # The run's own checkpoints hold its parameters: where it started from
  # no longer matters (and may be gone).
  config.init_from = None
  return config


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps of the checkpoints in `workdir`, sorted (complete or not:
  a restore says which do not verify)."""
  directory = storage.path(workdir) / 'checkpoints'
  return sorted(int(path.name) for path in directory.iterdir()
                if path.name.isdigit()) if directory.is_dir() else []


def no_checkpoint(workdir: str, step: int) -> str | None:
  """What a reader asking for checkpoint `step` of `workdir` is told where
  it has none (None: it has one)."""
  steps = checkpoint_steps(workdir)
  if step in steps:
    return None
  return (f'{workdir} has no checkpoint of step {step}; it has '
          + (f'step{"s" * (len(steps) > 1)} {", ".join(map(str, steps))}'
             if steps else 'none'))


def restore_params(workdir: str, abstract_params: Any,
                   step: int | None = None) -> tuple[int, Any]:
  """(step, parameters) of the run in `workdir` at checkpoint `step`
  (default: its newest that verifies), read alone (not the optimizer's
  state) into `abstract_params`' shardings and dtypes; InputError where it
  has none, or that one does not verify."""
  # A reader deletes nothing: what it keeps does not matter.
  checkpointer = checkpointing.Checkpointer(workdir, keep=1, read_only=True)
  try:
    if step is None:
      restored = checkpointer.restore_latest_params(abstract_params)
      if restored is None:
        raise InputError(f'{workdir} has no checkpoint yet.')
      return restored
    try:
      return step, checkpointer.restore_params(step, abstract_params)
    except checkpointing.Damaged as damage:
      raise InputError(f'the checkpoint of step {step} in {workdir} does '
                       f'not verify: {damage}') from None
  finally:
    checkpointer.close()


def load(workdir: str, decoder: str | None = None) -> TrainedRun:
  """The run in `workdir` at its newest checkpoint that verifies (see
  checkpointing.Checkpointer.restore_latest_params); InputError if it has
  none.
  `decoder`, the module of the command that decodes the run: InputError
  first, before any checkpoint is read, unless it is its task's
  (Task.decode_command) and the model reads a key/value cache."""
  config = load_config(workdir)
  task = datasets.task_of(config.dataset)
  command = task.decode_command and task.decode_command[1]
  if decoder and decoder != command:
    raise InputError(
        f'{decoder} does not decode {workdir}: it holds a run of family '
        f'{config.model.family!r} on {config.dataset!r} ({task.name})'
        + (f', which {command} decodes.' if command else '.'))
  program = Program.from_config(config, jax.devices()[:1])
  refusal = decoder and decoding.cache_refusal(program.model_config)
  if refusal:
    raise InputError(f'{decoder} decodes with a cache, and in the '
                     f'run in {workdir} {refusal}.')
  config = program.config
  dataset = datasets.load(config, workdir)
  step, params = restore_params(workdir, program.abstract_state.params)
  return TrainedRun(config, program.model, dataset, params, step)
