"""config.init_from's transfer of parameters between model configs."""

import dataclasses

import jax
import numpy as np
import pytest

from model import ModelConfig
from tests.helpers import tiny_runs
from train.base.errors import InputError
from train.run import init_from
from train.run.trainer import train_and_evaluate

SOURCE = ModelConfig(d_model=8, num_heads=4, head_dim=2, num_layers=1,
                     mlp_dim=16)


def _params(kv_heads: int, mlp_dim: int = 16, extra: bool = False):
  rng = np.random.RandomState(kv_heads)
  attention = {name: {'kernel': rng.normal(size=(8, kv_heads, 2)),
                      'bias': rng.normal(size=(kv_heads, 2))}
               for name in ('key', 'value')}
  attention['query'] = {'kernel': rng.normal(size=(8, 4, 2))}
  tree = {'block_0': {'self_attention': attention,
                      'mlp': {'wi': {'kernel': rng.normal(size=(8, mlp_dim))}}}}
  if extra:
    tree['block_0']['self_attention']['relative'] = {
        'embedding': np.zeros((5, 2))}
  return jax.tree.map(lambda x: x.astype(np.float32), tree)


def test_fewer_kv_heads_are_mean_pooled_groups():
  """4 -> 2 key/value heads: head j of the target is the mean of source
  heads 2j and 2j + 1 (the query heads it serves); the rest is copied."""
  source = _params(4)
  target = dataclasses.replace(SOURCE, num_kv_heads=2)
  got = init_from.transfer(source, _params(2, extra=True), SOURCE, target,
                           'W')
  for name in ('key', 'value'):
    kernel = source['block_0']['self_attention'][name]['kernel']
    expected = np.stack([kernel[:, 0:2].mean(1), kernel[:, 2:4].mean(1)], 1)
    np.testing.assert_allclose(
        got.params['block_0']['self_attention'][name]['kernel'], expected,
        rtol=1e-6)
    bias = source['block_0']['self_attention'][name]['bias']
    np.testing.assert_allclose(
        got.params['block_0']['self_attention'][name]['bias'],
        np.stack([bias[0:2].mean(0), bias[2:4].mean(0)]), rtol=1e-6)
  np.testing.assert_array_equal(
      got.params['block_0']['mlp']['wi']['kernel'],
      source['block_0']['mlp']['wi']['kernel'])
  assert len(got.pooled) == 4 and len(got.taken) == 2
  assert got.fresh == ('block_0/self_attention/relative/embedding',)
  assert got.summary() == (
      '2 parameters taken as they are; 4 key/value projection parameters '
      'mean-pooled to fewer heads; 1 new, initialised fresh '
      '(block_0/self_attention/relative/embedding)')


def test_blocks_one_by_one_start_a_deeper_scanned_model_pooled_alike():
  """Two blocks into a scanned target of three with half the kv heads:
  each block's projections pooled in its place of the stacked arrays, the
  third block fresh."""
  source = {'block_0': _params(4)['block_0'], 'block_1': _params(4)['block_0']}
  source['block_1'] = jax.tree.map(lambda x: x + 1, source['block_1'])
  fresh = {'layers': {'block_0': jax.tree.map(
      lambda x: np.stack([x, x, x]), _params(2)['block_0'])}}
  target = dataclasses.replace(SOURCE, num_layers=3, num_kv_heads=2,
                               scan_layers=True)
  got = init_from.transfer(source, fresh, SOURCE, target, 'W')
  stacked = got.params['layers']['block_0']
  for layer in (0, 1):
    kernel = source[f'block_{layer}']['self_attention']['key']['kernel']
    np.testing.assert_allclose(
        stacked['self_attention']['key']['kernel'][layer],
        np.stack([kernel[:, 0:2].mean(1), kernel[:, 2:4].mean(1)], 1),
        rtol=1e-6)
    np.testing.assert_array_equal(
        stacked['mlp']['wi']['kernel'][layer],
        source[f'block_{layer}']['mlp']['wi']['kernel'])
  np.testing.assert_array_equal(
      stacked['mlp']['wi']['kernel'][2],
      fresh['layers']['block_0']['mlp']['wi']['kernel'][2])
  assert len(got.pooled) == 8 and len(got.taken) == 4
  assert len(got.fresh) == 6 and got.fresh[0].startswith('block_2/')


def test_a_change_of_shape_is_refused_by_key():
  target = dataclasses.replace(SOURCE, mlp_dim=12)
  with pytest.raises(InputError, match=(
      r'config.init_from=W: parameters of it do not fit this model '
      r'\(block_0/mlp/wi/kernel \[8, 16\] there, \[8, 12\] here; 1 in '
      r'all\); '
      r'config.model differs in mlp_dim \(16 -> 12\)')):
    init_from.transfer(_params(4), _params(4, mlp_dim=12), SOURCE, target,
                       'W')


def test_source_of_a_checkpoint_or_a_workdir(tmp_path):
  assert init_from.run_source(str(tmp_path / 'run' / 'checkpoints' / '40')
                              ) == (str(tmp_path / 'run'), 40)
  assert init_from.run_source(str(tmp_path)) == (str(tmp_path), None)
  assert 'has no config.json' in init_from.check(str(tmp_path), 'new')
  # A run that has checkpoints resumes from them: its source may be gone.
  (tmp_path / 'resumed' / 'checkpoints' / '8').mkdir(parents=True)
  assert init_from.check(str(tmp_path), str(tmp_path / 'resumed')) is None


def test_a_source_that_does_not_fit_is_refused_before_the_workdir_is_made(
    tmp_path, data_dir):
  """The shapes are compared before the run claims its workdir: the
  refusal leaves no config.json, lock or checkpoints/ behind."""
  source = tiny_runs.tiny_config('lm_stdlib', data_dir)
  (tmp_path / 'source').mkdir()
  (tmp_path / 'source' / 'config.json').write_text(
      source.to_json_best_effort())
  target = tiny_runs.tiny_config('lm_stdlib', data_dir)
  target.model.mlp_dim = 48
  target.init_from = str(tmp_path / 'source')
  with pytest.raises(InputError, match=(
      r'parameters of it do not fit this model .*; config.model differs in '
      r'mlp_dim \(32 -> 48\)')):
    train_and_evaluate(target, str(tmp_path / 'tuned'))
  assert not (tmp_path / 'tuned').exists()
