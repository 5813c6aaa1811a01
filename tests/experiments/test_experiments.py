"""The experiment scripts: comparisons, sweeps, launch commands, maps."""

import csv
import itertools
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import grid
from experiments import attention_maps, common, compare_attention
from experiments import launch, length_generalisation, study, sweep, trials
from model import build
from model.config import ModelConfig
from tests.helpers import REPO
from tests.helpers.recount import recount
from tests.helpers.tiny_runs import TINY_LISTOPS, tiny_config
from train import cli
from train.base.errors import InputError, TrainingError
from train.data import tasks
from train.decode import seq2seq_eval
from train.program import steps
from train.run import metrics, trained_run

PNG = b'\x89PNG'


@pytest.fixture(scope='module')
def comparison(data_dir, tmp_path_factory):
  """dense and linformer trained on tiny ListOps, measured at two
  lengths."""
  workdir = str(tmp_path_factory.mktemp('compare'))
  config = tiny_config('listops', data_dir)
  rows = compare_attention.compare(
      config, ['dense', 'linformer'], workdir, lengths=[32, 16],
      timing_steps=1, command='test')
  return workdir, rows


def test_compare_writes_the_table_csv_and_plots(comparison):
  workdir, rows = comparison
  with open(os.path.join(workdir, 'results.csv')) as f:
    table = list(csv.DictReader(f))
  assert [row['variant'] for row in table] == ['dense', 'linformer']
  assert list(table[0]) == [
      'variant', 'status', 'eval_accuracy', 'eval_loss', 'params',
      'train_step_ms', 'tokens_per_s', 'peak_memory_mb', 'temp_memory_mb',
      'step_ms@16', 'temp_mb@16', 'step_ms@32', 'temp_mb@32']
  for row in table:
    assert row['status'] == 'trained'
    assert 0.0 <= float(row['eval_accuracy']) <= 1.0
    for key in ('train_step_ms', 'tokens_per_s', 'step_ms@32'):
      assert float(row[key]) > 0
    assert float(row['temp_mb@32']) > float(row['temp_mb@16'])
    assert float(row['peak_memory_mb']) > float(row['temp_memory_mb'])
  # Linformer owns its projections.
  assert int(table[1]['params']) > int(table[0]['params'])
  results = open(os.path.join(workdir, 'results.md')).read()
  assert 'Command: `test`' in results and '| dense | trained |' in results
  for name in ('curves.png', 'scaling.png'):
    with open(os.path.join(workdir, name), 'rb') as f:
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
      config, ['dense'], workdir, lengths=[32, 16], timing_steps=1)
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
      config, ['dense', 'local'], workdir, options=options, lengths=[32, 16],
      timing_steps=1, skip_unrunnable=True)
  assert dense == rows[0]
  assert local['status'].startswith('skipped: config.model does not build')


def test_compare_refuses_a_config_no_variant_can_run(data_dir, tmp_path):
  config = tiny_config('lm_stdlib', data_dir)
  with pytest.raises(InputError, match='no variant can run this config: '
                     'linformer: .* cannot be causal'):
    compare_attention.compare(config, ['linformer'], str(tmp_path / 'c'))
  assert not (tmp_path / 'c').exists()


def test_attention_maps_of_a_trained_checkpoint(comparison, monkeypatch):
  workdir = os.path.join(comparison[0], 'dense')
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
    attention_maps.attention_maps(os.path.join(comparison[0], 'linformer'),
                                  example=0)


def test_attention_weights_mask_padding(comparison):
  config = trained_run.load_config(os.path.join(comparison[0], 'dense'))
  model = build(ModelConfig.from_mapping(config.model))
  params = steps.init_params(model, tasks.CLASSIFICATION, jax.random.key(0), 8)
  tokens = np.array([3, 4, 5, 6, 0, 0], np.int32)  # Two padding tokens.
  (name, weights), = attention_maps.attention_weights(model, params, tokens)
  assert name == 'encoder/block_0'
  assert weights.shape == (2, 7, 7)  # Heads; the CLS vector, then tokens.
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(weights[..., -2:], 0.0)  # Padding unseen.


# --- sweeps ---

SWEEP_CONFIG = TINY_LISTOPS + '''

def get_sweep():
  # The last trial fails as it runs: its data_dir cannot be made.
  return grid.zipped(learning_rate=[1e-3, 3e-3, 1e-3],
                     data_dir=[{data_dir!r}, {data_dir!r}, '/dev/null/data'])
'''


def sweep_config(data_dir, tmp_path) -> pathlib.Path:
  """SWEEP_CONFIG written to a file in `tmp_path`."""
  config_path = tmp_path / 'sweep_config.py'
  config_path.write_text(SWEEP_CONFIG.format(
      data_dir=data_dir, steps=4, log_every=2, eval_every=4,
      checkpoint_every=4))
  return config_path


def test_sweep_records_a_failure_and_skips_finished_trials(comparison,
                                                           data_dir,
                                                           tmp_path):
  del comparison  # Its tiny ListOps dataset is the trials' (built once).
  config_path = sweep_config(data_dir, tmp_path)
  workdir = str(tmp_path / 'sweep')
  rows = sweep.sweep(str(config_path), workdir, parallel=2)
  assert [row['status'] for row in rows] == ['finished', 'finished', 'failed']
  assert [row['rank'] for row in rows[:2]] == [1, 2]
  assert rows[2]['error'].startswith(
      "config.data_dir='/dev/null/data' cannot hold the dataset: ")
  board = open(os.path.join(workdir, 'leaderboard.md')).read()
  assert 'failed' in board and 'learning_rate' in board
  with open(os.path.join(workdir, 'sweep.png'), 'rb') as f:
    assert f.read(4) == PNG

  finished = os.path.join(workdir, trials.trial_name(
      {'learning_rate': 1e-3, 'data_dir': data_dir}), 'trial.json')
  before = os.path.getmtime(finished)
  again = sweep.sweep(str(config_path), workdir, parallel=2)
  assert os.path.getmtime(finished) == before  # Not run again.
  assert [row['status'] for row in again] == ['finished', 'finished',
                                              'failed']


def failed_run(command, **kwargs):
  """What a trial's train.train leaves when it fails at once."""
  kwargs['stdout'].write('error: boom\n')
  return subprocess.CompletedProcess(command, returncode=1)


def test_a_sweep_with_no_finished_trial_fails_and_keeps_the_reports(
    data_dir, tmp_path, monkeypatch):
  config_path = sweep_config(data_dir, tmp_path)
  workdir = tmp_path / 'sweep'
  workdir.mkdir()
  (workdir / 'leaderboard.md').write_text('an earlier sweep')
  monkeypatch.setattr(trials.subprocess, 'run', failed_run)
  with pytest.raises(TrainingError, match='no trial finished; the first, '
                     r'.*, failed: boom \(its log: '):
    sweep.sweep(str(config_path), str(workdir))
  assert (workdir / 'leaderboard.md').read_text() == 'an earlier sweep'
  assert not (workdir / 'leaderboard.csv').exists()


def test_a_sweep_refuses_a_metric_before_any_trial(data_dir, tmp_path,
                                                   monkeypatch):
  config_path = sweep_config(data_dir, tmp_path)

  def refuse(*args, **kwargs):
    raise AssertionError('a trial ran')
  monkeypatch.setattr(trials.subprocess, 'run', refuse)
  with pytest.raises(InputError, match='--metric=eval_acc: no trial logs '
                     'it; did you mean eval_accuracy'):
    sweep.sweep(str(config_path), str(tmp_path / 'sweep'), metric='eval_acc')
  with pytest.raises(InputError, match='--mode: say whether --metric='
                     'grad_norm is better low'):
    sweep.sweep(str(config_path), str(tmp_path / 'sweep'),
                metric='grad_norm')
  assert not (tmp_path / 'sweep').exists()


def test_a_trial_stopped_by_a_signal_is_not_finished(tmp_path, monkeypatch):
  workdir = str(tmp_path / 'trial')

  def stopped_at_step_5(command, **kwargs):
    # What train.train leaves after SIGTERM at step 5 of 10: exit status 0.
    common.save_json(os.path.join(workdir, 'config.json'),
                     {'num_train_steps': 10})
    with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
      f.write('{"step": 5, "eval_loss": 1.0}\n')
    return subprocess.CompletedProcess(command, returncode=0)

  monkeypatch.setattr(trials.subprocess, 'run', stopped_at_step_5)
  record = trials.run_trial('configs/listops.py', workdir, {}, {})
  assert record['status'] == 'stopped'
  assert 'run the sweep again' in record['error']


@pytest.mark.core
def test_leaderboard_ranks_by_the_metric_and_lists_failures_last():
  def record(rate, status='finished', value=None):
    record = {'overrides': {'learning_rate': rate}, 'status': status}
    if status == 'finished':
      record['metrics'] = {'eval_loss': value}
    else:
      record['error'] = 'boom'
    return record

  records = [record(1, value=2.0), record(2, 'failed'),
             record(3, value=float('nan')), record(4, value=1.0)]
  low = sweep.leaderboard(records, 'eval_loss', 'min')
  assert [row['trial'] for row in low] == [
      'learning_rate=4', 'learning_rate=1', 'learning_rate=2',
      'learning_rate=3']
  assert [row.get('rank') for row in low] == [1, 2, None, None]
  assert low[2]['error'] == 'boom' and low[3]['error'] == 'eval_loss is nan'
  high = sweep.leaderboard(records, 'eval_loss', 'max')
  assert [row['trial'] for row in high[:2]] == ['learning_rate=1',
                                                'learning_rate=4']


def test_grid_helpers():
  assert grid.product(a=[1, 2], b=['x']) == [{'a': 1, 'b': 'x'},
                                              {'a': 2, 'b': 'x'}]
  assert grid.zipped(a=[1, 2], b=[3, 4]) == [{'a': 1, 'b': 3},
                                             {'a': 2, 'b': 4}]
  with pytest.raises(ValueError, match='one length'):
    grid.zipped(a=[1], b=[1, 2])


def test_listops_config_defines_a_search_valid_at_every_bound():
  config = str(REPO / 'configs' / 'listops.py')
  space = trials.load_sweep(config + ':full')
  assert set(space.space) == {'learning_rate', 'warmup_steps',
                              'model.dropout_rate'}
  assert study.check(config, space, {}, None, None) == ('eval_accuracy',
                                                        'max')


# --- the length-generalisation study ---

STUDY = str(REPO / 'configs' / 'length_generalisation.py')


def decoded_reversals(count: int, seed: int) -> list[dict]:
  """Inputs of 1-400 symbols and their reversals, some written right, some
  with wrong, missing or extra symbols."""
  rng = np.random.default_rng(seed)
  examples = []
  for _ in range(count):
    inputs = [int(i) for i in rng.integers(2, 12, int(rng.integers(1, 401)))]
    reference = inputs[::-1] + [1]
    hypothesis = list(reference)
    if rng.random() < 0.7:
      cut = int(rng.integers(0, len(hypothesis)))
      hypothesis = hypothesis[:cut] + [int(i) for i in rng.integers(
          2, 12, int(rng.integers(0, 30)))] + [1]
    examples.append({'inputs': inputs + [1], 'hypothesis': hypothesis,
                     'reference': reference})
  return examples


@pytest.mark.core
def test_length_buckets_equal_a_brute_force_recount():
  examples = decoded_reversals(300, seed=0)
  rows = length_generalisation.by_length(examples)
  assert [row['lengths'] for row in rows] == [
      f'{low}-{high}' for low, high in length_generalisation.BUCKETS]
  assert sum(row['examples'] for row in rows) == len(examples)
  for row, (low, high) in zip(rows, length_generalisation.BUCKETS):
    assert row == pytest.approx(recount(examples, low, high))


def test_the_study_sweeps_every_position_scheme_on_three_tasks():
  """Every cell is the same config but for its task and position scheme,
  and each decodes both splits greedily."""
  cells = trials.load_sweep(STUDY)
  assert [(cell['dataset_options.task'], cell['model.position'])
          for cell in cells] == list(itertools.product(
              ('copy', 'reverse', 'addition'),
              ('none', 'sinusoidal', 'learned', 'relative', 't5_bias', 'rope',
               'alibi', 'random_sinusoidal')))
  configs = [cli.load_config(STUDY, cell) for cell in cells]
  first = metrics.flat_hparams(configs[0].to_dict())
  for cell, config in zip(cells, configs):
    keys = metrics.flat_hparams(config.to_dict())
    assert set(keys) == set(first)
    differ = {key for key, value in keys.items() if first[key] != value}
    assert differ <= set(cell), differ
    assert config.decode_splits == ('validation', 'long')
    assert config.beam_size == 1 and config.eval_every == (
        config.num_train_steps)
    assert config.dataset_options.max_length == 40
    assert config.dataset_options.long_max_length == 400
  # A learned table reaches the longest output decoded.
  assert seq2seq_eval.output_length(configs[2].model, 401, 0,
                                    names='long') == int(1.5 * 401) + 10


def test_the_study_reports_its_finished_cells(tmp_path):
  """Two cells finished, the others not yet: their table rows, every
  bucket in buckets.csv, the plot, and the cells still to run."""
  cells = trials.load_sweep(STUDY)[:2]
  decoded = {}
  for number, cell in enumerate(cells):
    directory = tmp_path / trials.trial_name(cell)
    (directory / 'decoded').mkdir(parents=True)
    common.save_json(str(directory / 'trial.json'),
                     {'status': 'finished', 'seconds': 90.0})
    for split, seed in (('validation', 2 * number),
                        ('long', 2 * number + 1)):
      decoded[number, split] = decoded_reversals(40, seed)
      with open(directory / 'decoded' / f'{split}.jsonl', 'w') as f:
        f.writelines(json.dumps(e) + '\n' for e in decoded[number, split])
  out = tmp_path / 'out'
  length_generalisation.report(str(tmp_path), str(out), 'the command')
  text = (out / 'results.md').read_text()
  assert 'the command' in text and 'add up to 3 minutes' in text
  assert ('Not finished yet: dataset_options.task=copy,model.position=learned'
          in text)
  with open(out / 'results.csv') as f:
    rows = list(csv.DictReader(f))
  assert [row['position'] for row in rows] == ['none', 'sinusoidal']
  whole = recount(decoded[1, 'long'], 0, 10**6)
  assert float(rows[1]['long tokens']) == pytest.approx(
      whole['token_accuracy'])
  assert float(rows[1]['301-400']) == pytest.approx(
      recount(decoded[1, 'long'], 301, 400)['token_accuracy'])
  with open(out / 'buckets.csv') as f:
    buckets = list(csv.DictReader(f))
  assert len(buckets) == sum(
      1 + len(length_generalisation.by_length(examples))
      for examples in decoded.values())
  with open(out / 'length_generalisation.png', 'rb') as f:
    assert f.read(4) == PNG


# --- launch ---

TRAIN = ['python', '-m', 'train.train', '--config=configs/lm1b.py',
         '--workdir=gs://bucket/run']


def test_tpu_launch_commands_run_on_every_worker():
  commands = launch.tpu_commands('pod', 'us-east5-a', 'v5p-64',
                                 'v2-alpha-tpuv5', True, TRAIN)
  create, archive, copy, install, mount, start = commands
  assert create[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create',
                        'pod']
  assert '--accelerator-type=v5p-64' in create
  assert archive[3:5] == ['archive', '--format=tar.gz']
  assert copy[4] == 'scp' and '--worker=all' in copy
  for command in (install, mount, start):
    assert command[4:6] == ['ssh', 'pod'] and '--worker=all' in command
  assert 'jax[tpu]' in install[-1]
  assert 'gcsfuse --implicit-dirs bucket /gcs/bucket' in mount[-1]
  assert start[-1].endswith(
      'nohup .venv/bin/python -m train.train --config=configs/lm1b.py '
      '--workdir=/gcs/bucket/run --config.distributed=True '
      '> train.log 2>&1 &')


def test_launch_dry_run_prints_commands_and_slurm_script():
  run = lambda *args: subprocess.run(
      [sys.executable, '-m', 'experiments.launch', *args, '--dry_run', '--',
       *TRAIN[:-1], '--workdir=/shared/run'], cwd=REPO, capture_output=True,
      text=True, check=True).stdout
  # The working tree, which the suite's own runs may add files to.
  tpu = run('--tpu=pod', '--zone=z', '--accelerator=v6e-64',
            '--include_uncommitted').splitlines()
  assert len(tpu) == 4  # Archive, copy, install, start: no create.
  assert 'git ls-files -z --cached --others --exclude-standard' in tpu[0]
  assert '--worker=all' in tpu[-1]
  script = run('--slurm', '--nodes=4', '--gpus_per_node=8',
               '--cpus_per_task=48')
  assert '#SBATCH --nodes=4' in script
  assert '#SBATCH --ntasks-per-node=1' in script
  assert '#SBATCH --cpus-per-task=48' in script
  assert 'export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7' in script
  assert script.rstrip().endswith(
      'srun .venv/bin/python -m train.train --config=configs/lm1b.py '
      '--workdir=/shared/run --config.distributed=True')

