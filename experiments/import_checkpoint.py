r"""Command line: a published checkpoint as a training run's workdir.

  python -m experiments.import_checkpoint --from=DIR --format=hf_gpt2 \
      --workdir=workdirs/gpt2 [--config=configs/published.py:gpt2 \
      --config.key=value ...]

Reads a Hugging Face model directory from disk (config.json and
*.safetensors, as PyTorch's or Flax's save_pretrained wrote them; no
network): config.json gives the architecture's sizes
(train/run/pretrained.py, by --format: hf_gpt2 or hf_llama), the tensors
its parameters, each shape checked. The config is --config (default: the
format's preset in configs/published.py) with the preset's architecture
and those sizes set over it, so --config chooses the rest (dataset, dtype,
batch) and not the model (a --config.model override of a key it sets is
refused); the workdir, which must not hold a run (an import cut short
while it wrote its checkpoint is completed by the same command), gets its
config.json and a verified checkpoint of step 0 holding the parameters
alone (a run that resumes it makes the optimizer's state, fresh at step
0). Then

  python -m train.generate --workdir=workdirs/gpt2 --prompt="def "
  python -m train.train --config=configs/published.py:from=workdirs/gpt2 \
      --config.model.attention=local --workdir=workdirs/gpt2_local

sample from it and fine-tune it (with any compatible change: see
config.init_from). Where the directory holds the model's tokenizer.json
(and tokenizer_config.json), they are copied into the workdir and the run's
config.tokenizer names the copy: the text dataset (python_stdlib_bytes,
text_files) is read in the model's own tokens, and train.generate's
--prompt too. Without one, the model reads the dataset's token ids
(python_stdlib_bytes: bytes, ids 2-257), as the command says; either way
they must fit its vocabulary.

A directory that cannot be read as the format (a file missing, an
architecture the model cannot express, a tensor of another shape) is one
line naming it, exit status 2.
"""

from collections.abc import Collection, Iterable
import os

from absl import flags
from flax import traverse_util
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np

from configs import default, published
from model import layer_stack
from train import cli
from train.base import storage
from train.base.errors import InputError
from train.config import validation as config_validation
from train.data import datasets, tokenizers
from train.run import checkpointing, pretrained, trainer
from train.run.hf_formats import FORMATS
from train.run import workdir as workdir_lib
from train.program.steps import TrainState
from train.run.program import Program

FLAGS = flags.FLAGS


def _check_tree(params, abstract, source: str) -> None:
  """InputError unless `params` has `abstract`'s paths and shapes: what the
  format gives is what the model declares."""
  have = traverse_util.flatten_dict(params, sep='/')
  want = traverse_util.flatten_dict(abstract, sep='/')
  for path in sorted(have.keys() | want.keys()):
    if path not in have or path not in want:
      raise InputError(
          f'--from={source}: the model built from it has a parameter {path} '
          'that it does not give' if path in want else
          f'--from={source} gives a parameter {path} the model lacks')
    if have[path].shape != want[path].shape:
      raise InputError(
          f'--from={source}: parameter {path} is {list(have[path].shape)}; '
          f'the model built from its config.json declares '
          f'{list(want[path].shape)}.')


def _refuse_architecture_overrides(overrides: Iterable[str],
                                   architecture: Collection[str],
                                   source: str) -> None:
  """InputError for a --config.model.KEY=... override (`overrides`: the
  keys typed) of a key in `architecture`, which the import sets."""
  for key in overrides:
    name = key.split('.')[1] if key.startswith('model.') else None
    if name in architecture:
      raise InputError(
          f'--config.{key}: the import takes config.model.{name} from '
          f'--from={source} (its architecture); change it when fine-tuning '
          f'the import: --config=configs/published.py:from=WORKDIR '
          f'--config.{key}=...')


def import_config(source: str, format_name: str, config=None,
                  overrides: Iterable[str] = ()
                  ) -> tuple[ml_collections.ConfigDict, dict]:
  """(the run's config, the checkpoint's config.model keys): `config`
  (default: the format's preset) with the preset's architecture and the
  checkpoint's sizes set over it, whatever it held, and no attention
  option set. `overrides`: the keys typed as --config.KEY=...; InputError
  for one of config.model that the import sets."""
  keys = pretrained.model_keys(source, format_name)
  preset = FORMATS[format_name].preset
  _refuse_architecture_overrides(
      overrides, {*published.PRESETS[preset], *keys, 'attention_options'},
      source)
  if config is None:
    config = published.get_config(preset)
  with_architecture(config, format_name, keys)
  config.seq_len = min(config.seq_len, keys['max_len'])
  return config, keys


def with_architecture(config: ml_collections.ConfigDict, format_name: str,
                      keys: dict) -> ml_collections.ConfigDict:
  """`config` with the format's architecture (its preset's config.model
  keys, `keys` over them, no attention option set) over config.model, in
  place; the other keys (its layout: dtype, scan_layers, ...) kept."""
  config.model.update(published.PRESETS[FORMATS[format_name].preset] | keys)
  config.model.attention_options = default.attention_options()
  return config


def _check_new(workdir: str) -> None:
  """InputError where `workdir` holds a run: an import writes step 0 of a
  new one, and a run's own checkpoint would be kept (orbax does not write
  a step twice) under the import's checksums. An import cut short while
  it wrote its checkpoint holds none: the same import completes it."""
  held = workdir_lib.run_record(workdir)
  if held and not (held == ['checkpoints'] and _cut_short(workdir)):
    raise InputError(
        f'--workdir={workdir} already holds a run ({", ".join(held)}): an '
        'import writes a new one; give a new --workdir, or delete this one '
        'first.')


def _cut_short(workdir: str) -> bool:
  """Whether the checkpoints of `workdir` are a start's save that did not
  complete: of step 0 alone, and none complete (a start's resume deletes
  what it left)."""
  steps = {path.name.split('.')[0] for path in
           (storage.path(workdir) / 'checkpoints').iterdir()}
  checkpointer = checkpointing.Checkpointer(workdir, keep=1, read_only=True)
  try:
    return (checkpointer.latest_step() is None
            and {step for step in steps if step.isdigit()} == {'0'})
  finally:
    checkpointer.close()


def write_start(config: ml_collections.ConfigDict, program: Program,
                dataset: datasets.Dataset, params, workdir: str) -> None:
  """Claims `workdir` for `config` (its run's, `program`'s) and writes its
  checkpoint of step 0, a start: `params` (laid out as `program`'s) and a
  fresh data iterator's position, no optimizer state (at step 0 it is its
  fresh one, which a run resuming the start makes). A run that init_from
  reads, and train.generate samples, or that trains on from there."""
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                     opt_state=None)
  with workdir_lib.claim(config, workdir):
    iterator = trainer.training_batches(program, dataset)
    checkpointer = checkpointing.Checkpointer(
        workdir, keep=program.config.keep_checkpoints)
    try:
      checkpointer.save(0, state, iterator)
    finally:
      iterator.close()
      checkpointer.close()


def import_checkpoint(source: str, format_name: str, workdir: str,
                      config=None, overrides: Iterable[str] = ()) -> str:
  """Writes `workdir` (config.json and the checkpoint of step 0) from the
  checkpoint in `source`, nothing when it cannot be read or `workdir`
  holds a run; returns a line saying what it wrote. `overrides`: the
  config keys typed (see import_config)."""
  source = os.path.expanduser(source)
  _check_new(workdir)
  config, keys = import_config(source, format_name, config, overrides)
  own_tokenizer = os.path.isfile(os.path.join(source,
                                              tokenizers.HF_TOKENIZER))
  if own_tokenizer:  # The run reads text as the model was trained to.
    config.tokenizer = source
  else:
    print(f'--from={source} has no {tokenizers.HF_TOKENIZER}: the model '
          f'reads the token ids of config.dataset={config.dataset!r}.',
          flush=True)
  program = Program.from_config(config, jax.devices()[:1])
  checked = program.config
  abstract = program.abstract_state.params
  # Each parameter on the device in its dtype as it is read; the format's
  # blocks one by one, stacked if the config scans them.
  dtypes = {path: leaf.dtype for path, leaf in traverse_util.flatten_dict(
      layer_stack.unstacked(abstract), sep='/').items()}
  params = layer_stack.relayout(pretrained.params(
      source, format_name, keys, lambda path, array: jax.device_put(
          np.asarray(array, dtypes.get(path, array.dtype)),
          program.mesh.devices.flat[0])), abstract)
  _check_tree(params, abstract, source)
  # The dataset's token ids (its tokenizer's) must fit the vocabulary.
  dataset = datasets.load(checked, workdir)
  config_validation.check_dataset_fits(
      checked, dataset, vocabulary=f'--from={source}: its vocab_size')
  # The workdir's claim copies the tokenizer's files in.
  write_start(config, program, dataset,
              jax.device_put(params, program.state_sharding.params), workdir)
  return (f'Imported {program.num_params:,} parameters from {source} '
          f'({format_name}) into {workdir}: its config.json'
          + (f', its {tokenizers.HF_TOKENIZER}' if own_tokenizer else '')
          + ' and the checkpoint of step 0.')


def main(argv: list[str]) -> None:
  # The --config.KEY=... overrides typed (none without --config).
  overrides = (config_flags.get_override_values(FLAGS['config'])
               if FLAGS['config'].present else {})
  print(cli.run_main(argv, lambda: import_checkpoint(
      FLAGS['from'].value, FLAGS.format, FLAGS.workdir, FLAGS.config,
      overrides)))


def _define_flags() -> None:
  flags.DEFINE_string('from', None, 'A Hugging Face model directory: '
                      'config.json and *.safetensors.')
  flags.DEFINE_enum('format', None, list(FORMATS),
                    'The architecture of the checkpoint.')
  flags.DEFINE_string('workdir', None, 'The new run\'s workdir.')
  config_flags.DEFINE_config_file(
      'config', None, 'The config the run gets (default: the format\'s '
      'preset in configs/published.py); the checkpoint sets its '
      'architecture keys.', lock_config=False)
  flags.mark_flags_as_required(['from', 'format', 'workdir'])


if __name__ == '__main__':
  cli.run(main, _define_flags)
