r"""Command line: a training run's checkpoint as a Hugging Face model
directory, the inverse of experiments.import_checkpoint.

  python -m experiments.export_checkpoint --workdir=W --format=hf_gpt2 \
      --to=DIR [--step=N]

Writes DIR/config.json and DIR/model.safetensors (PyTorch's names and
layout, in the parameters' dtype), which transformers' GPT2LMHeadModel or
LlamaForCausalLM load, from the parameters of checkpoint N (default: the
newest that verifies), read alone and whatever mesh the run trained on;
and the run's tokenizer.json (config.tokenizer's, with the
tokenizer_config.json beside it) where it has one. Importing DIR gives the
run's parameters and config.model back bit for bit.

The format must express the run's model: its config.model is written as
the format's config.json, read back as an import reads it, and any key
that comes back otherwise (another attention, position scheme, norm,
experts, QK-norm, ...) is refused by name, exit status 2, nothing written.
An attention that computes dense's function exactly (chunked, ring) is
the format's, and imports back as dense. DIR must not exist or be empty.
"""

import copy
import dataclasses
import os

from absl import flags
import jax
import ml_collections

from experiments.import_checkpoint import with_architecture
from model import ModelConfig, attention, layer_stack
from train import cli
from train.base import storage
from train.base.errors import InputError
from train.data import tokenizers
from train.run import init_from, pretrained, trained_run
from train.run.hf_formats import FORMATS, HfConfig
from train.run.program import Program

FLAGS = flags.FLAGS


def check_expressible(config: ml_collections.ConfigDict, model: ModelConfig,
                      format_name: str) -> None:
  """InputError naming the config.model keys of a run (`config`, and
  `model` checked) that `format_name` does not express: those that differ
  once the model is written as the format's config.json and read back."""
  if all(attention.spec(layer.attention).exact
         for layer in model.layer_configs()):
    # Dense's function, however computed here: the format's attention.
    model = dataclasses.replace(model, attention='dense',
                                attention_options=())
  checkpoint_format = FORMATS[format_name]
  values = checkpoint_format.write_keys(model)
  keys = checkpoint_format.read_keys(HfConfig('config.json', values))
  written = ModelConfig.from_mapping(with_architecture(
      copy.deepcopy(config), format_name, keys).model)
  if written != model:
    differing = init_from.config_differences(model, written)
    raise InputError(
        f'--format={format_name} cannot express this run\'s model: '
        f"config.model differs in {differing} (the run's value -> the "
        "format's).")


def export_checkpoint(workdir: str, format_name: str, target: str,
                      step: int | None = None) -> str:
  """Writes `target` from the run in `workdir` (see the module docstring);
  returns a line saying what it wrote."""
  if format_name not in FORMATS:
    raise InputError(f'--format={format_name!r} must be one of '
                     f'{list(FORMATS)}.')
  if os.path.exists(target) and (not os.path.isdir(target)
                                 or os.listdir(target)):
    raise InputError(f'--to={target} exists and is not an empty directory.')
  config = trained_run.load_config(workdir)
  missing = step is not None and trained_run.no_checkpoint(workdir, step)
  if missing:
    raise InputError(f'--step={step}: {missing}.')
  program = Program.from_config(config, jax.devices()[:1])
  check_expressible(config, program.model_config, format_name)
  tokenizer_files = ({} if config.tokenizer is None
                     else tokenizers.hf_files(config.tokenizer))
  step, params = trained_run.restore_params(
      workdir, program.abstract_state.params, step)
  params = layer_stack.unstacked(jax.device_get(params))
  pretrained.write(target, params, format_name, program.model_config)
  written = ['config.json', 'model.safetensors']
  for name, source in tokenizer_files.items():
    storage.write_whole(storage.path(target) / name, source.read_bytes())
    written.append(name)
  return (f'Exported {program.num_params:,} parameters of {workdir} at step '
          f'{step} to {target} ({format_name}): {", ".join(written)}.')


def main(argv: list[str]) -> None:
  print(cli.run_main(argv, lambda: export_checkpoint(
      FLAGS.workdir, FLAGS.format, FLAGS.to, FLAGS.step)))


def _define_flags() -> None:
  flags.DEFINE_string('workdir', None, 'A training run\'s workdir.')
  flags.DEFINE_enum('format', None, list(FORMATS),
                    'The architecture to write.')
  flags.DEFINE_string('to', None, 'The directory to write (new or empty).')
  flags.DEFINE_integer('step', None, 'The checkpoint to export (default: '
                       'the newest that verifies).')
  flags.mark_flags_as_required(['workdir', 'format', 'to'])


if __name__ == '__main__':
  cli.run(main, _define_flags)
