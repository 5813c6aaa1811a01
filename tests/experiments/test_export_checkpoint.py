"""experiments.export_checkpoint: transformers loads what it writes, and an
import of it gives the run back bit for bit (parameters and config.model),
from one device or eight, scanned or not; a model the format cannot
express is refused by its keys with nothing written."""

import dataclasses
import os
import re

import jax
import numpy as np
import pytest

from configs import published
from experiments.export_checkpoint import export_checkpoint
from experiments.import_checkpoint import import_checkpoint
from model import ModelConfig
from tests.helpers import hf_models, tiny_runs
from train.base.errors import InputError
from train.run import trained_run
from train.run.program import Program


def _same_run(original: str, imported: str) -> None:
  """The parameters bit for bit (dtypes included) and config.model of the
  two runs' latest checkpoints."""
  want, got = trained_run.load(original), trained_run.load(imported)
  assert got.model_config == want.model_config
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(
      np.asarray(a), np.asarray(b), strict=True), got.params, want.params)


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
def test_an_export_loads_in_transformers_and_imports_back_bit_for_bit(
    name, tmp_path, data_dir):
  """The reference, imported (Llama into a model that scans its layers),
  exported: transformers' own class reads the export to the reference's
  logits, and importing it gives the import back."""
  reference, saved = hf_models.saved(name, tmp_path)
  config = published.get_config(name)
  config.update(data_dir=data_dir, seq_len=32, batch_size=4)
  config.model.scan_layers = name == 'llama'
  import_checkpoint(saved, f'hf_{name}', str(tmp_path / 'run'), config)
  said = export_checkpoint(str(tmp_path / 'run'), f'hf_{name}',
                           str(tmp_path / 'out'))
  assert said.endswith(f'at step 0 to {tmp_path / "out"} (hf_{name}): '
                       'config.json, model.safetensors.')
  loaded = hf_models.CLASSES[name].from_pretrained(str(tmp_path / 'out'))
  np.testing.assert_allclose(loaded(hf_models.TOKENS_BxT).logits,
                             reference(hf_models.TOKENS_BxT).logits,
                             rtol=1e-6, atol=1e-6)
  import_checkpoint(str(tmp_path / 'out'), f'hf_{name}',
                    str(tmp_path / 'back'), config)
  _same_run(str(tmp_path / 'run'), str(tmp_path / 'back'))


def test_a_run_sharded_on_eight_devices_exports_its_checkpoint_by_step(
    tmp_path, data_dir):
  """A bfloat16 Llama with biases and chunked attention (dense's function)
  saved by FSDP over 8 devices: step 0 exports and imports back bit for
  bit, its attention as dense; step 1, whose readout bias (which Llama's
  lm_head lacks) is not zero, is refused by that parameter, and a step
  the run lacks by --step, naming those it has, nothing written."""
  config = tiny_runs.shrink(published.get_config('llama'), data_dir,
                            seq_len=16)
  config.model.update(param_dtype='bfloat16', use_bias=True, num_kv_heads=1,
                      attention='chunked')
  config.parallelism.update(data=1, fsdp=8)
  program = Program.from_config(config, jax.devices())
  state = program.init()
  workdir = tmp_path / 'run'
  params = jax.tree_util.tree_map_with_path(
      lambda path, leaf: leaf + 1 if 'output_projection' in str(path)
      else leaf, state.params)
  tiny_runs.saved_run(config, workdir,
                      {0: state, 1: state.replace(params=params)})

  export_checkpoint(str(workdir), 'hf_llama', str(tmp_path / 'out'), step=0)
  import_checkpoint(str(tmp_path / 'out'), 'hf_llama', str(tmp_path / 'back'),
                    trained_run.load_config(str(workdir)))
  want = trained_run.restore_params(str(workdir),
                                    program.abstract_state.params, 0)[1]
  got = trained_run.load(str(tmp_path / 'back'))
  assert got.model_config == dataclasses.replace(
      ModelConfig.from_mapping(config.model), attention='dense')
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(
      np.asarray(a), np.asarray(b), strict=True), got.params, want)
  with pytest.raises(InputError, match=re.escape(
      '--format=hf_llama has no place for the parameter '
      'embedder/output_projection/bias, which is not zero.')):
    export_checkpoint(str(workdir), 'hf_llama', str(tmp_path / 'one'),
                      step=1)
  with pytest.raises(InputError, match=re.escape(
      f'--step=99: {workdir} has no checkpoint of step 99; it has steps 0, '
      '1.')):
    export_checkpoint(str(workdir), 'hf_llama', str(tmp_path / 'one'),
                      step=99)
  assert not os.path.exists(tmp_path / 'one')
