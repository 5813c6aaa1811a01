"""A train step that cannot fit is refused before anything is traced or
compiled, by a lower bound of what it holds that the config alone gives;
the compiled step needs at least that bound."""

import time

import jax
import pytest

from configs import default, lm_stdlib
from train import train
from train.base.errors import InputError
from train.config import layout as layout_validation
from train.config import validation as config_validation
from train.program import device_memory
from train.run.program import Program


def test_an_impossible_length_is_refused_before_anything_is_traced(
    tmp_path, capsys, monkeypatch):
  """make train's config with rows of a million tokens, on the 8 test
  devices sharing a host of 32 GiB: each block's input, kept for the
  backward pass, and one feed-forward layer's hidden activations exceed
  their share (the compiled step would need 2,603 GiB on one device), so
  neither the model's trace nor the step's compilation (100 to 200 s on
  2 cores) is waited for."""
  monkeypatch.setattr(config_validation, 'device_bytes', lambda: 4 * 2**30)
  monkeypatch.setattr(layout_validation, 'trace_model',
                      lambda *args: pytest.fail('the model was traced'))
  config = lm_stdlib.get_config()
  config.seq_len = 1_000_000
  started = time.perf_counter()
  with pytest.raises(SystemExit) as exit_:
    train.run(config, str(tmp_path / 'run'))
  assert time.perf_counter() - started < 30
  assert exit_.value.code == 2
  [line] = capsys.readouterr().err.splitlines()
  # 16 rows x 10^6 tokens x 4 blocks x 128 float32 values over 8 devices,
  # and as many of 512 for one layer: 3.8 GiB each.
  assert line.startswith('error: a train step needs at least 7.6 GiB on '
                         'each device, which holds 4.0 GiB: lower config.'
                         'batch_size=16 or config.seq_len=1000000, ')
  assert line.endswith('; counted before compiling: block inputs 3.8 GiB, '
                       'feed-forward activations 3.8 GiB.')
  assert not (tmp_path / 'run').exists()


def test_where_the_bound_allows_a_step_its_compilation_decides(monkeypatch):
  """Two dense layers on one device: the bound (the parameters, each
  block's input and the largest tensor of a layer, here its attention
  weights) is below what the compiled step needs; a device that holds
  what lies between passes the bound and refuses the compiled step."""
  config = default.get_config()
  config.update(batch_size=8, seq_len=128, sample_length=0)
  config.model.update(vocab_size=64, d_model=32, num_heads=2, num_layers=2,
                      mlp_dim=64, max_len=128)
  program = Program.from_config(config, jax.devices()[:1])
  batch = program.batch(program.task.synthetic_batch(program.config))
  with program.scope():
    compiled = program.train_step.lower(program.abstract_state, batch,
                                        program.key(1)).compile()
  bound = device_memory.least_step_bytes(program.config, program.task, 128,
                                         1, program.num_params)
  # 8 x 128 tokens x 2 blocks x 32 float32 values; 8 rows x 2 heads x
  # 128 x 128 float32 weights, more than the 64 hidden values a token.
  assert bound['block inputs'] == 8 * 128 * 2 * 32 * 4
  assert bound['attention weights'] == 8 * 2 * 128 * 128 * 4
  assert bound['parameters'] == program.num_params * 4
  needed = device_memory.needed_bytes(compiled.memory_analysis())
  assert sum(bound.values()) <= needed
  monkeypatch.setattr(config_validation, 'device_bytes',
                      lambda: (sum(bound.values()) + needed) // 2)
  config_validation.check_step_bound(program.config, program.task, 1, 128,
                                     program.abstract_state.params)
  with pytest.raises(InputError, match=(
      f'^a train step needs {needed / 2**20:.1f} MiB on each device, which '
      'holds ')):
    config_validation.check_step_fits(compiled, program.config)
