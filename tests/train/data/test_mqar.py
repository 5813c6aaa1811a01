"""Multi-query associative recall: the generator, its task's rows, and a
dense model that learns it."""

import grain
import numpy as np
import pytest

from configs import mqar as mqar_config
from tests.helpers.tiny_runs import tiny_config
from train.base.errors import InputError
from train.base.train_config import TrainConfig
from train.data import datasets, mqar, tasks
from train.run.trainer import train_and_evaluate

CONFIG = mqar.MqarConfig(vocab_size=64, num_pairs=5, length=40,
                         num_train=50, num_eval=20)


def _check_pairs_and_answers(inputs: np.ndarray, targets: np.ndarray):
  """The pairs at the start of `inputs`: distinct keys from the lower half
  of the ids, distinct values from the upper; each key asked once, after
  the pairs, on an even offset from them, and scored there alone, on the
  value it was paired with."""
  pairs, half = CONFIG.num_pairs, CONFIG.vocab_size // 2
  paired = dict(zip(inputs[0:2 * pairs:2].tolist(),
                    inputs[1:2 * pairs:2].tolist()))
  assert len(paired) == len(set(paired.values())) == pairs
  assert all(1 <= key < half <= value for key, value in paired.items())
  asked = np.flatnonzero(targets)
  assert len(asked) == pairs and asked.min() >= 2 * pairs
  assert np.all((asked - 2 * pairs) % 2 == 0)
  assert sorted(inputs[asked].tolist()) == sorted(paired)
  for position in asked:
    assert targets[position] == paired[int(inputs[position])]


@pytest.mark.parametrize('split', mqar.SPLITS)
def test_each_answer_is_the_value_its_key_was_paired_with(split):
  source = mqar.Examples(CONFIG, split)
  assert len(source) == CONFIG.size(split)
  for index in range(len(source)):
    inputs, targets = source[index]['inputs'], source[index]['targets']
    assert inputs.shape == targets.shape == (CONFIG.length,)
    assert inputs.dtype == targets.dtype == np.int32
    assert 1 <= inputs.min() and inputs.max() < CONFIG.vocab_size
    _check_pairs_and_answers(inputs, targets)


def test_without_random_fillers_the_tokens_between_queries_are_zero():
  config = mqar.MqarConfig(**{**CONFIG.__dict__, 'random_fillers': False})
  for index in range(20):
    example = mqar.example(config, 'train', index)
    inputs, targets = example['inputs'], example['targets']
    _check_pairs_and_answers(inputs, targets)
    fillers = np.ones(config.length, bool)
    fillers[:2 * config.num_pairs] = fillers[np.flatnonzero(targets)] = False
    np.testing.assert_array_equal(inputs[fillers], 0)


def test_examples_are_one_per_seed_split_and_index():
  again = mqar.Examples(CONFIG, 'train')
  first = mqar.Examples(CONFIG, 'train')[3]
  np.testing.assert_array_equal(again[3]['inputs'], first['inputs'])
  assert not np.array_equal(mqar.Examples(CONFIG, 'validation')[3]['inputs'],
                            first['inputs'])
  other = mqar.MqarConfig(**{**CONFIG.__dict__, 'seed': 1})
  assert not np.array_equal(mqar.Examples(other, 'train')[3]['inputs'],
                            first['inputs'])
  with pytest.raises(IndexError):
    again[len(again)]


def test_queries_come_soon_after_the_pairs_more_often():
  """The gaps' power law: query slots near the pairs are asked more."""
  p = mqar.gap_probabilities(10, 0.01)
  assert p.sum() == pytest.approx(1.0) and np.all(np.diff(p) < 0)
  np.testing.assert_allclose(mqar.gap_probabilities(4, 1.0), 0.25)
  config = mqar.MqarConfig(vocab_size=64, num_pairs=2, length=24,
                           num_train=400)
  slots = np.concatenate([np.flatnonzero(mqar.example(config, 'train', i)[
      'targets']) for i in range(400)]) - 4
  counts = np.bincount(slots // 2, minlength=10)
  assert counts[0] > counts[4] > counts[9]


@pytest.mark.parametrize('options, message', [
    ({'length': 18, 'num_pairs': 5}, 'length=18 must be even and at least '
     '4 \\* num_pairs = 20'),
    ({'length': 41}, 'length=41 must be even'),
    ({'vocab_size': 8, 'num_pairs': 4, 'length': 16}, 'vocab_size=8 has 3 key '
     'ids, fewer than num_pairs=4'),
    ({'power_a': 0.0}, r'power_a=0.0 must be in \(0, 1\]'),
    ({'num_train': 0}, 'num_train=0 must be an integer >= 1'),
    ({'random_fillers': 1}, 'random_fillers=1 must be True or False'),
])
def test_settings_no_example_can_meet_are_named(options, message):
  config = TrainConfig(dataset='mqar', dataset_options=options)
  with pytest.raises(InputError, match='config.dataset_options.' + message):
    datasets.load(config, '')


def test_a_recall_row_is_scored_on_the_answers_alone():
  example = mqar.example(CONFIG, 'train', 0)
  row, = list(tasks.MQAR.rows(
      None, grain.MapDataset.source([example]), seq_len=48, seed=0,
      train=False, layout='padded', max_segments=None))
  np.testing.assert_array_equal(row['inputs'][:40], example['inputs'])
  np.testing.assert_array_equal(row['inputs'][40:], 0)
  np.testing.assert_array_equal(row['weights'], row['targets'] > 0)
  assert row['weights'].sum() == CONFIG.num_pairs
  np.testing.assert_array_equal(row['positions'], np.arange(48))


def test_the_config_takes_a_cell_of_the_grid():
  config = mqar_config.get_config('length=128,pairs=16')
  assert config.seq_len == config.dataset_options.length == 128
  assert config.dataset_options.num_pairs == 16
  assert config.model.vocab_size == config.dataset_options.vocab_size
  # Twice the length, twice the steps: (128, 8) takes dense past 2,000.
  assert config.num_train_steps == 2 * mqar_config.get_config().num_train_steps
  with pytest.raises(ValueError, match='configs/mqar.py takes length=<int>,'
                     "pairs=<int>, got 'width=3'"):
    mqar_config.get_config('width=3')


def test_a_small_dense_model_learns_four_pair_recall(data_dir, tmp_path):
  config = tiny_config('mqar', data_dir)
  # At a constant 3e-3, seeds 0, 1 and 2 answer 0.99 or more by step 200.
  config.schedule = 'constant'
  config.num_train_steps = config.eval_every = config.checkpoint_every = 400
  config.log_every = 100
  summary = train_and_evaluate(config, str(tmp_path))
  assert summary['eval_accuracy'] >= 0.99
