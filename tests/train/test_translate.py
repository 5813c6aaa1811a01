"""Decoding a seq2seq split from a trained run, and its scores: BLEU as
sacrebleu's command line gives it, exact match, per-token accuracy."""

import os
import subprocess
import sys

import pytest

from configs import algorithmic
from experiments import length_generalisation
from tests.helpers.recount import recount
from tests.helpers.tiny_runs import (LocalWmt14, read_metrics, shrink,
                                     tiny_config)
from train import translate
from train.base.errors import InputError
from train.decode import scores, seq2seq_eval
from train.run.trainer import train_and_evaluate


def test_bleu_of_files_equals_the_sacrebleu_command_line(tmp_path):
  hypotheses = ['the cat sat on the mat .', 'a dog barked loudly',
                'it rained all day , then it stopped']
  references = ['the cat sat on a mat .', 'the dog barked loudly',
                'it rained the whole day , then stopped']
  hyp, ref = tmp_path / 'test.hyp', tmp_path / 'test.ref'
  hyp.write_text('\n'.join(hypotheses) + '\n')
  ref.write_text('\n'.join(references) + '\n')
  command_line = subprocess.run(
      [sys.executable, '-m', 'sacrebleu', str(ref), '-i', str(hyp), '-b'],
      capture_output=True, text=True, check=True).stdout
  assert round(scores.bleu_of_files(str(hyp), str(ref)), 1) == float(
      command_line)
  assert 0 < float(command_line) < 100


def test_exact_match_and_token_accuracy():
  references = [[5, 6, 1], [7, 1]]
  assert scores.exact_match([[5, 6, 1], [7, 7, 1]], references) == 0.5
  # 3 of 5 reference tokens are where they belong.
  assert scores.token_accuracy([[5, 6, 1], [1]], references) == 0.6


@pytest.fixture(scope='module')
def translation_workdir(data_dir, tmp_path_factory):
  LocalWmt14(data_dir=data_dir, file_format='array_record'
             ).download_and_prepare()
  workdir = str(tmp_path_factory.mktemp('wmt'))
  train_and_evaluate(tiny_config('wmt14_ende', data_dir), workdir)
  return workdir


def test_translate_writes_hypotheses_and_scores_them(translation_workdir):
  result = translate.translate(translation_workdir, 'validation',
                               beam_size=2, batch_size=4, max_examples=6)
  assert result['examples'] == 6
  assert {'exact_match', 'token_accuracy', 'bleu'} <= set(result)
  for name in ('hyp', 'ref'):
    with open(os.path.join(translation_workdir, f'validation.{name}')) as f:
      assert len(f.read().splitlines()) == 6
  assert result['bleu'] == scores.bleu_of_files(
      os.path.join(translation_workdir, 'validation.hyp'),
      os.path.join(translation_workdir, 'validation.ref'))


def test_training_logs_the_bleu_of_its_decoded_validation_split(
    translation_workdir):
  """The trainer decodes as train.translate does (beam 4, the first 8
  sentences)."""
  [last] = [row for row in read_metrics(translation_workdir)
            if 'decode_validation_bleu' in row][-1:]
  result = translate.translate(translation_workdir, 'validation',
                               beam_size=4, max_examples=8)
  for name in ('bleu', 'exact_match', 'token_accuracy'):
    assert last[f'decode_validation_{name}'] == pytest.approx(
        result[name], abs=1e-6), name
  # What it decoded is kept, with the inputs.
  decoded = seq2seq_eval.read_decoded(
      os.path.join(translation_workdir, 'decoded', 'validation.jsonl'))
  assert len(decoded) == 8 and all(e['inputs'] for e in decoded)
  assert scores.token_accuracy(
      [e['hypothesis'] for e in decoded], [e['reference'] for e in decoded]
  ) == pytest.approx(last['decode_validation_token_accuracy'])


def test_translate_names_a_split_the_dataset_lacks(translation_workdir):
  with pytest.raises(InputError, match="--split='dev' is not a split"):
    translate.translate(translation_workdir, 'dev')


@pytest.mark.slow
def test_a_reverse_model_trained_300_steps_decodes_most_inputs(data_dir,
                                                               tmp_path):
  """Reversing up to 6 symbols: guessing gets about 1 in 10^length right;
  this model reached 84% (greedy and beam 4) when this test was written."""
  config = shrink(algorithmic.get_config('task=reverse'), data_dir, seq_len=8)
  config.dataset_options.update(num_train=5000, num_eval=100, max_length=6,
                                long_max_length=8)
  config.update(num_train_steps=300, warmup_steps=20, batch_size=32,
                log_every=100, eval_every=300, checkpoint_every=300,
                learning_rate=3e-3)
  config.model.update(d_model=32, num_heads=2, num_layers=2, mlp_dim=64)
  config.num_decode_examples = -1
  train_and_evaluate(config, str(tmp_path))
  results = {beam_size: translate.translate(str(tmp_path),
                                            beam_size=beam_size)
             for beam_size in (1, 4)}
  for result in results.values():
    assert result['exact_match'] > 0.6, results
  # Evaluations during training decode greedily as train.translate does
  # (to one example in 100: the devices differ), inputs of the training
  # lengths and the longer ones of `long`.
  final = read_metrics(str(tmp_path))[-1]
  assert final['decode_validation_exact_match'] == pytest.approx(
      results[1]['exact_match'], abs=0.011)
  assert 0 <= final['decode_long_token_accuracy'] < 1
  # The study's length buckets of what it decoded, against a recount.
  for split, buckets in (('validation', [(1, 3), (4, 6)]),
                         ('long', [(7, 7), (8, 8)])):
    decoded = seq2seq_eval.read_decoded(
        os.path.join(tmp_path, 'decoded', f'{split}.jsonl'))
    assert length_generalisation.by_length(decoded, buckets) == [
        pytest.approx(recount(decoded, low, high)) for low, high in buckets]
