"""config.init_from's transfer of parameters between model configs."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from model import ModelConfig
from tests.helpers import tiny_runs
from train.base.errors import InputError
from train.run import checkpointing, init_from, trained_run
from train.run.program import Program
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


def test_a_sharded_target_starts_from_the_parameters_alone_on_its_mesh(
    tmp_path, data_dir):
  """A source saved on one device starts an 8-device FSDP target that
  scans its 2 blocks and has half the key/value heads: every parameter
  arrives in the target's sharding, taken or pooled from the source's; the
  source's optimizer state is not read (its checksums, made wrong, are
  not looked at)."""
  source_config = tiny_runs.tiny_config('lm_stdlib', data_dir)
  source_config.model.num_layers = 2
  source = Program.from_config(source_config, jax.devices()[:1])
  state = source.init()
  workdir = tmp_path / 'source'
  tiny_runs.saved_run(source_config, workdir, {0: state})
  sums_path = workdir / 'checkpoints' / '0' / 'checksums' / 'metadata'
  sums = json.loads(sums_path.read_text())
  for path in sums['arrays']:
    if path.startswith('.opt_state'):
      sums['arrays'][path] = [0, 0]
  sums_path.write_text(json.dumps(sums))
  (workdir / 'checkpoints' / '0' / checkpointing.FILE_SIZES).unlink()

  target_config = tiny_runs.tiny_config('lm_stdlib', data_dir)
  target_config.model.update(num_layers=2, num_kv_heads=1, scan_layers=True)
  target_config.parallelism.update(data=1, fsdp=8)
  target = Program.from_config(target_config, jax.devices())
  transferred, said = init_from.load(str(workdir), target)
  params = transferred.params
  assert said.endswith('mean-pooled to fewer heads')
  for got, want in zip(jax.tree.leaves(params),
                       jax.tree.leaves(target.abstract_state.params)):
    assert got.sharding == want.sharding
  assert len(jax.tree.leaves(params)[0].sharding.device_set) == 8
  saved = jax.device_get(state.params)['decoder']
  stacked = jax.device_get(params)['decoder']['layers']['block_0']
  for layer in (0, 1):
    attention = saved[f'block_{layer}']['self_attention']
    np.testing.assert_array_equal(
        stacked['self_attention']['query']['kernel'][layer],
        attention['query']['kernel'])
    np.testing.assert_allclose(
        stacked['self_attention']['key']['kernel'][layer],
        attention['key']['kernel'].mean(axis=1, keepdims=True), rtol=1e-6)


def test_a_run_recorded_before_a_key_existed_reads_its_default(
    tmp_path, data_dir):
  """A source whose config.json predates a training key (config.tokenizer
  here) is read with that key at its default."""
  recorded = json.loads(
      tiny_runs.tiny_config('lm_stdlib', data_dir).to_json_best_effort())
  del recorded['tokenizer']
  (tmp_path / 'config.json').write_text(json.dumps(recorded))
  config = trained_run.load_config(str(tmp_path))
  assert config.tokenizer is None
  Program.from_config(config, jax.devices()[:1])
