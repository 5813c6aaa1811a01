"""experiments/compare_attention.py and experiments/attention_maps.py (on
the checkpoints a comparison trains)."""

import csv
import dataclasses
import os

import chex
import jax
import numpy as np
import pytest
from scipy import stats

from experiments import attention_maps, common, compare_attention
from model import build, layer_stack
from model.config import ModelConfig
from tests.helpers.tiny_runs import tiny_config
from train.base.errors import InputError
from train.data import tasks
from train.program import steps
from train.run import trained_run

PNG = b'\x89PNG'


@pytest.fixture(scope='module')
def comparison(data_dir, tmp_path_factory):
  """dense and linformer trained on tiny ListOps from two seeds at equal
  training FLOPs."""
  workdir = str(tmp_path_factory.mktemp('compare'))
  config = tiny_config('listops', data_dir)
  rows = compare_attention.compare(
      config, ['dense', 'linformer'], workdir, seeds=2, budget='flops',
      command='test')
  return workdir, rows


def test_compare_writes_the_table_csv_and_plots(comparison):
  workdir, rows = comparison
  with open(os.path.join(workdir, 'results.csv')) as f:
    table = list(csv.DictReader(f))
  assert [row['variant'] for row in table] == ['dense', 'linformer']
  assert list(table[0]) == [
      'variant', 'status', 'eval_accuracy', 'eval_accuracy_sd', 'p',
      'eval_loss', 'steps', 'gflop_per_step', 'train_gflop', 'params',
      'train_step_ms', 'tokens_per_s', 'peak_memory_mb', 'temp_memory_mb']
  for row in table:
    assert row['status'] == 'trained'
    assert 0.0 <= float(row['eval_accuracy']) <= 1.0
    assert float(row['eval_accuracy_sd']) >= 0.0
    for key in ('train_step_ms', 'tokens_per_s'):
      assert float(row[key]) > 0
    assert float(row['peak_memory_mb']) > float(row['temp_memory_mb'])
  # Linformer owns its projections.
  assert int(table[1]['params']) > int(table[0]['params'])
  results = open(os.path.join(workdir, 'results.md')).read()
  assert 'Command: `test`' in results and '| dense | trained |' in results
  with open(os.path.join(workdir, 'curves.png'), 'rb') as f:
    assert f.read(4) == PNG


def test_lengths_time_a_train_step_and_its_memory_at_each(data_dir,
                                                          tmp_path):
  """The @length columns (on synthetic batches), kept for a re-run, and
  their plot."""
  config = compare_attention.variant_config(
      tiny_config('listops', data_dir), 'dense', {}, unpacked=False)
  columns = compare_attention.length_scaling(config, str(tmp_path), [16, 32],
                                             timing_steps=1)
  assert list(columns) == ['step_ms@16', 'temp_mb@16', 'step_ms@32',
                           'temp_mb@32']
  assert columns['step_ms@32'] > 0
  assert columns['temp_mb@32'] > columns['temp_mb@16'] > 0
  assert compare_attention.length_scaling(config, str(tmp_path), [16, 32],
                                          timing_steps=1) == columns
  compare_attention.plot_scaling([{'variant': 'dense'} | columns], [16, 32],
                                 str(tmp_path / 'scaling.png'))
  with open(tmp_path / 'scaling.png', 'rb') as f:
    assert f.read(4) == PNG


def test_seeds_give_a_mean_a_deviation_and_p_against_the_baseline(
    comparison):
  workdir, (dense, linformer) = comparison
  for row in (dense, linformer):
    values = [common.load_json(os.path.join(
        workdir, row['variant'], f'seed={seed}', 'result.json'))[
            'eval_accuracy'] for seed in (0, 1)]
    assert row['values'] == values
    assert row['eval_accuracy'] == pytest.approx(np.mean(values))
    assert row['eval_accuracy_sd'] == pytest.approx(np.std(values, ddof=1))
  assert 'p' not in dense  # The baseline is not tested against itself.
  want = stats.ttest_ind(linformer['values'], dense['values'],
                         equal_var=False, alternative='greater').pvalue
  if np.isnan(want):  # Both seeds alike in both: no variance to test.
    assert np.isnan(linformer['p'])
  else:
    assert linformer['p'] == pytest.approx(want)


def test_equal_flops_give_a_cheaper_variant_more_steps(comparison):
  """dense trains config.num_train_steps; linformer as many steps as its
  own FLOPs a step buy with dense's training FLOPs."""
  _, (dense, linformer) = comparison
  assert dense['steps'] == 4
  assert linformer['gflop_per_step'] != dense['gflop_per_step']
  assert linformer['steps'] == round(
      4 * dense['gflop_per_step'] / linformer['gflop_per_step'])
  assert linformer['steps'] != dense['steps']
  assert linformer['train_gflop'] == pytest.approx(dense['train_gflop'],
                                                   rel=0.5)


def test_a_budget_of_seconds_times_each_variants_step():
  costs = {'dense': {'step_ms': 30.0}, 'linear': {'step_ms': 10.0}}
  assert compare_attention.budget_steps(costs, 100, 'dense', 'seconds') == {
      'dense': 100, 'linear': 300}
  assert compare_attention.budget_steps(costs, 100, 'linear', 'seconds',
                                        per_call=4) == {'dense': 32,
                                                        'linear': 100}
  with pytest.raises(InputError, match='--budget=flops: the FLOPs of dense '
                     'cannot be counted'):
    compare_attention.budget_steps({'dense': {'gflop_per_step': None}}, 10,
                                   'dense', 'flops')


def test_sizes_compare_at_each_width_against_its_compute(data_dir,
                                                       tmp_path):
  config = tiny_config('listops', data_dir)
  with pytest.raises(InputError, match='--sizes: d_model 9 is not a '
                     'multiple of config.model.num_heads=2'):
    compare_attention.compare(config, ['dense'], str(tmp_path / 'odd'),
                              sizes=[8, 9])
  assert not (tmp_path / 'odd').exists()
  small, large = compare_attention.compare(config, ['dense'], str(tmp_path),
                                           sizes=[16, 8])
  assert (small['d_model'], large['d_model']) == (8, 16)
  assert small['train_gflop'] < large['train_gflop']
  assert small['params'] < large['params']
  with open(tmp_path / 'results.csv') as f:
    table = list(csv.DictReader(f))
  assert [row['d_model'] for row in table] == ['8', '16']
  for name in ('d_model=8/results.md', 'd_model=16/results.md'):
    assert (tmp_path / name).exists()
  with open(tmp_path / 'sizes.png', 'rb') as f:
    assert f.read(4) == PNG


def test_compare_does_not_train_a_finished_variant_again(comparison,
                                                         data_dir,
                                                         monkeypatch):
  workdir, rows = comparison
  config = tiny_config('listops', data_dir)

  def refuse(*args):
    raise AssertionError('trained again')

  monkeypatch.setattr(compare_attention, 'train_and_evaluate', refuse)
  again = compare_attention.compare(
      config, ['dense'], workdir, seeds=2, budget='flops')
  assert again[0] == rows[0]


def test_compare_skips_a_variant_that_cannot_run_only_when_asked(
    comparison, data_dir, monkeypatch, tmp_path):
  """local at window 0 does not build; dense is trained already."""
  workdir, rows = comparison
  config = tiny_config('listops', data_dir)
  options = {'local': {'window': 0}}
  with pytest.raises(InputError, match=(
      r'--variants: local cannot run this config \(local: config.model does '
      r'not build .*window=0 must be positive.*\); leave it out, or give '
      '--skip_unrunnable to compare the others.')):
    compare_attention.compare(config, ['dense', 'local'],
                              str(tmp_path / 'c'), options=options)
  assert not (tmp_path / 'c').exists()
  monkeypatch.setattr(compare_attention, 'train_and_evaluate',
                      lambda *args: pytest.fail('trained again'))
  dense, local = compare_attention.compare(
      config, ['dense', 'local'], workdir, options=options,
      skip_unrunnable=True, seeds=2, budget='flops')
  assert dense == rows[0]
  assert local['status'].startswith('skipped: config.model does not build')


def test_the_configs_own_attention_options_are_left_out_and_said(
    comparison, data_dir, monkeypatch, capsys):
  """A config whose own attention has options (make train's windows by
  layer): each variant runs without them, as the comparison's dense
  did."""
  workdir, rows = comparison
  config = tiny_config('listops', data_dir)
  config.model.attention = 'local,local'
  config.model.attention_options.local.window = (8, 4)
  monkeypatch.setattr(compare_attention, 'train_and_evaluate',
                      lambda *args: pytest.fail('trained again'))
  dense, = compare_attention.compare(config, ['dense'], workdir, seeds=2,
                                     budget='flops')
  assert dense == rows[0]
  assert ('config.model.attention_options (local.window=(8, 4)) '
          "belong to config.model.attention='local,local', which each "
          'variant replaces: left out') in capsys.readouterr().out


def test_compare_refuses_a_config_no_variant_can_run(data_dir, tmp_path):
  config = tiny_config('lm_stdlib', data_dir)
  with pytest.raises(InputError, match='no variant can run this config: '
                     'linformer: .* cannot be causal'):
    compare_attention.compare(config, ['linformer'], str(tmp_path / 'c'))
  assert not (tmp_path / 'c').exists()


def test_attention_maps_of_a_trained_checkpoint(comparison, monkeypatch):
  workdir = os.path.join(comparison[0], 'dense', 'seed=0')
  drawn = {}
  draw = attention_maps.draw
  monkeypatch.setattr(attention_maps, 'draw', lambda layers, labels, path: (
      drawn.update(layers=layers, labels=labels), draw(layers, labels, path)))
  path = attention_maps.attention_maps(workdir, example=0)
  with open(path, 'rb') as f:
    assert f.read(4) == PNG
  (name, weights), = drawn['layers']  # One layer of two heads.
  labels = drawn['labels']
  assert name == 'encoder/block_0' and labels[0] == '[CLS]'
  assert weights.shape == (2, len(labels), len(labels))
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
  with pytest.raises(InputError, match='exact softmax attention'):
    attention_maps.attention_maps(
        os.path.join(comparison[0], 'linformer', 'seed=0'), example=0)


def test_attention_weights_mask_padding(comparison):
  config = trained_run.load_config(os.path.join(comparison[0], 'dense',
                                                    'seed=0'))
  model = build(ModelConfig.from_mapping(config.model))
  params = steps.init_params(model, tasks.CLASSIFICATION, jax.random.key(0), 8)
  tokens = np.array([3, 4, 5, 6, 0, 0], np.int32)  # Two padding tokens.
  (name, weights), = attention_maps.attention_weights(model, params, tokens)
  assert name == 'encoder/block_0'
  assert weights.shape == (2, 7, 7)  # Heads; the CLS vector, then tokens.
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(weights[..., -2:], 0.0)  # Padding unseen.


def test_a_scanned_stacks_maps_are_its_blocks_one_by_one(comparison):
  config = ModelConfig.from_mapping(trained_run.load_config(
      os.path.join(comparison[0], 'dense', 'seed=0')).model)
  plain = build(dataclasses.replace(config, num_layers=2))
  scanned = build(dataclasses.replace(config, num_layers=2,
                                      scan_layers=True))
  params = steps.init_params(plain, tasks.CLASSIFICATION, jax.random.key(0),
                             8)
  stacked = layer_stack.relayout(params, steps.init_params(
      scanned, tasks.CLASSIFICATION, jax.random.key(0), 8))
  tokens = np.array([3, 4, 5, 6, 0, 0], np.int32)
  want = attention_maps.attention_weights(plain, params, tokens)
  got = attention_maps.attention_weights(scanned, stacked, tokens)
  assert [name for name, _ in got] == [name for name, _ in want] == [
      'encoder/block_0', 'encoder/block_1']
  chex.assert_trees_all_close([weights for _, weights in got],
                              [weights for _, weights in want], rtol=1e-5,
                              atol=1e-7)


def test_no_two_of_thirty_series_are_plotted_alike():
  styles = [tuple(sorted(common.series_style(number).items()))
            for number in range(30)]
  assert len(set(styles)) == 30
