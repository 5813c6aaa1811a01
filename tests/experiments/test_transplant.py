"""experiments.transplant on a tiny source: stage 1 lowers each trained
variant's attention-output error, stage 2 and the scratch runs train, the
table has every variant; a variant that cannot take the source is refused
by name before anything is written."""

import os
import re

import numpy as np
import pytest

from experiments import transplant
from tests.helpers import tiny_runs
from train.base.errors import InputError
from train.run.program import Program


@pytest.fixture(scope='module')
def source(data_dir, tmp_path_factory) -> str:
  """A run of make train's model at toy size (ALiBi, QK-norm), two layers,
  saved at its initialisation (a teacher need not be trained; its
  attention's output projections not zero, so that it says something)."""
  config = tiny_runs.tiny_config('lm_stdlib', data_dir)
  config.model.update(num_layers=2, zero_init_outputs=False)
  config.num_eval_steps = 1
  workdir = tmp_path_factory.mktemp('source')
  tiny_runs.saved_run(config, workdir,
                      {0: Program.from_config(config).init()})
  return str(workdir)


@pytest.mark.slow
def test_stage_one_teaches_hedgehog_and_every_variant_gets_a_row(source,
                                                                 tmp_path):
  """hedgehog (its feature maps new, ALiBi replaced by no positions) learns
  in stage 1; local has nothing to learn there; both fine-tune and train
  from scratch."""
  workdir = str(tmp_path / 'transplant')
  rows = transplant.transplant(
      source, ['hedgehog', 'local'], workdir, steps=2, distill_steps=3,
      options={'local': {'window': 8}},
      model={'hedgehog': {'position': 'none'}}, eval_every=2)
  assert [row['variant'] for row in rows] == ['hedgehog', 'local']
  hedgehog, local = rows
  assert hedgehog['error_after'] < hedgehog['error_before']
  assert hedgehog['stage_1'] == '2 arrays trained'
  assert local['stage_1'] == 'nothing to learn' and local['new_params'] == 0
  for row in rows:
    for key in ('source', 'before', 'after_stage_2', 'scratch', 'step_ms',
                'peak_memory_mb'):
      assert np.isfinite(row[key]), (row['variant'], key)
  with open(os.path.join(workdir, 'results.md')) as f:
    table = f.read()
  assert '| hedgehog | 256 |' in table and '| local | 0 |' in table
  assert os.path.exists(os.path.join(workdir, 'curves.png'))
  assert os.path.exists(os.path.join(workdir, 'hedgehog', 'transferred',
                                     'checkpoints', '0'))


def test_a_variant_that_cannot_take_the_source_is_refused_by_name(
    source, tmp_path):
  """performer cannot take the source's ALiBi bias, linformer cannot be
  causal: both named, before anything is written."""
  workdir = tmp_path / 'refused'
  with pytest.raises(InputError) as raised:
    transplant.transplant(source, ['local', 'performer', 'linformer'],
                          str(workdir), steps=2)
  message = str(raised.value)
  assert re.match(r"--variants: performer: config.model.position='alibi' "
                  r'adds a bias to the logits.*; linformer: ', message)
  assert 'local' not in message
  assert not workdir.exists()
