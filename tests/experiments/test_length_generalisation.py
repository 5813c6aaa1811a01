"""experiments/length_generalisation.py: the study's cells and its
scores by input length."""

import csv
import itertools
import json

import numpy as np
import pytest

from experiments import common, length_generalisation, trials
from tests.helpers import REPO
from tests.helpers.recount import recount
from train import cli
from train.decode import seq2seq_eval
from train.run import metrics

PNG = b'\x89PNG'


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
