"""experiments.transplant on a tiny source: stage 1 lowers a trained
variant's attention-output error, stage 2 and the scratch run train, the
table has the variant's row; a variant with no new parameters has nothing
to learn in stage 1; a variant that cannot take the source is refused by
name before anything is written."""

import os
import re

import numpy as np
import pytest

from experiments import transplant
from tests.helpers import tiny_runs
from train.base.errors import InputError
from train.run import init_from
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
def test_stage_one_teaches_hedgehog_and_its_row_is_written(source, tmp_path):
  """hedgehog (its feature maps new, ALiBi replaced by no positions) learns
  in stage 1, fine-tunes from there and trains from scratch; its row, its
  line of the table and the curves are written."""
  workdir = str(tmp_path / 'transplant')
  # Stage 2 at the source's own rates: it and the scratch run then compile
  # one train step (the rates are constants of the compiled step).
  rows = transplant.transplant(
      source, ['hedgehog'], workdir, steps=2, distill_steps=3,
      learning_rate_scale=1.0, model={'hedgehog': {'position': 'none'}},
      eval_every=2)
  [hedgehog] = rows
  assert hedgehog['variant'] == 'hedgehog'
  assert hedgehog['error_after'] < hedgehog['error_before']
  assert hedgehog['stage_1'] == '2 arrays trained'
  for key in ('source', 'before', 'after_stage_1', 'after_stage_2',
              'scratch', 'step_ms', 'peak_memory_mb'):
    assert np.isfinite(hedgehog[key]), key
  with open(os.path.join(workdir, 'results.md')) as f:
    table = f.read()
  assert '| hedgehog | 256 |' in table
  assert os.path.exists(os.path.join(workdir, 'curves.png'))
  assert os.path.exists(os.path.join(workdir, 'hedgehog', 'transferred',
                                     'checkpoints', '0'))


def test_a_variant_with_no_new_parameters_has_nothing_to_learn(source,
                                                               tmp_path):
  """local takes every parameter of the source as it is: none new, stage 1
  says it has nothing to learn and writes nothing, and stage 2 starts from
  the source itself."""
  config = transplant.stage_config(
      source, 'local', {'local': {'window': 8}}, {}, steps=2, eval_every=2,
      unpacked=False)
  assert config.init_from == source
  program = Program.from_config(config)
  transferred, _ = init_from.load(source, program)
  assert not transferred.fresh and transferred.taken
  # It returns before it reads the teacher or the data: None for them.
  stage = transplant._stage_one(
      None, None, config, program, None, transferred, str(tmp_path),
      steps=3, distill='new', learning_rate=1e-2,
      metric='eval_bits_per_byte')
  assert stage == {'stage_1': 'nothing to learn'}
  assert not any(tmp_path.iterdir())


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


def test_a_source_that_is_no_run_is_refused_by_from(source, tmp_path):
  """A workdir that is not there, and a checkpoint its run lacks: named by
  --from, with the steps there are, before anything is written."""
  missing = str(tmp_path / 'none')
  for given, line in (
      (missing, f"--from={missing} is not a training run's workdir (it has "
                'no config.json) nor one of its checkpoints '
                '(WORKDIR/checkpoints/STEP).'),
      (f'{source}/checkpoints/99',
       f'--from={source}/checkpoints/99: {source} has no checkpoint of step '
       '99; it has step 0.')):
    with pytest.raises(InputError, match=re.escape(line)):
      transplant.transplant(given, ['local'], str(tmp_path / 'w'), steps=2)
  assert not (tmp_path / 'w').exists()
