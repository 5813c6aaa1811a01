"""End to end: every config trains a few steps, saves, resumes, evaluates."""

import json
import os
import pathlib
import time
import types

import pytest
import tensorflow_datasets as tfds

from model import ModelConfig
from tests.helpers.tiny_runs import LocalWmt14, read_metrics, tiny_config
from train.config import validation as config_validation
from train.data import datasets, tasks
from train.decode import decoding
from train.run import metrics, trainer
from train.run.trainer import train_and_evaluate


TRAIN_KEYS = {'step', 'loss', 'accuracy', 'learning_rate', 'grad_norm',
              'tokens_per_s', 'steps_per_s', 'mfu'}
EVAL_KEYS = {
    'lm_stdlib': {'eval_loss', 'eval_accuracy', 'eval_bits_per_byte'},
    'algorithmic': {'eval_loss', 'eval_accuracy', 'eval_exact_match',
                    'decode_validation_exact_match',
                    'decode_validation_token_accuracy',
                    'decode_long_exact_match', 'decode_long_token_accuracy'},
    'listops': {'eval_loss', 'eval_accuracy'},
    'lm1b': {'eval_loss', 'eval_accuracy'},
    'wmt14_ende': {'eval_loss', 'eval_accuracy', 'eval_exact_match',
                   'decode_validation_exact_match',
                   'decode_validation_token_accuracy',
                   'decode_validation_bleu'},
}


def checkpoint_steps(workdir) -> list[int]:
  return sorted(int(p.name) for p in (pathlib.Path(workdir) / 'checkpoints')
                .iterdir() if p.name.isdigit())


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(EVAL_KEYS))
def test_config_trains_saves_and_resumes(name, data_dir, tmp_path, capsys,
                                        monkeypatch):
  if name == 'lm_stdlib':
    # Compiling seems to take 1000 s: the first interval's throughput
    # excludes it.
    offset = [0.0]
    monkeypatch.setattr(metrics, 'time', types.SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + offset[0],
        time=time.time, monotonic=time.monotonic))
    fits = config_validation.check_step_fits

    def slow_compile(*args):
      offset[0] += 1000.0
      return fits(*args)
    monkeypatch.setattr(config_validation, 'check_step_fits', slow_compile)
  if name == 'wmt14_ende':
    LocalWmt14(data_dir=data_dir, file_format='array_record'
               ).download_and_prepare()
  workdir = str(tmp_path / name)
  config = tiny_config(name, data_dir)
  if name == 'lm_stdlib':
    # Pallas flash attention, interpreted, on each device's share of the
    # batch.
    config.model.update(attention='chunked',
                        attention_options={'kernel': 'pallas_gpu'},
                        position='rope')  # The kernels take no ALiBi bias.
  # A constant rate, so that the run can be extended (a cosine schedule
  # depends on num_train_steps).
  config.schedule = 'constant'

  def run():
    if name == 'lm1b':
      with tfds.testing.mock_data(num_examples=64):
        return train_and_evaluate(config, workdir)
    return train_and_evaluate(config, workdir)

  final = run()
  assert set(final) == EVAL_KEYS[name]
  out = capsys.readouterr().out
  if name == 'lm_stdlib':  # The start-up line names the kernel.
    assert ('Attention kernels: decoder layer 0 chunked: pallas_gpu (as set; '
            'float32, causal, packed rows; interpreted on the CPU: slow, for '
            'tests)') in out
    assert read_metrics(workdir)[0]['steps_per_s'] > 0.02
    assert '\nCorpus sha256 ' in out  # On or off make train's track.
  # The closing summary: steps, the final metric, the checkpoint.
  metric, _ = datasets.task_of(config.dataset).quality_metric(final)
  assert 'Done: steps 0-4 in ' in out
  assert f'{metric} {final[metric]:.4g}' in out
  assert f'Last checkpoint: {workdir}/checkpoints/4; ' in out
  # Only a schedule that does not depend on num_train_steps extends.
  assert 'run the same command with a larger config.num_train_steps' in out
  assert 'a larger config.num_train_steps' not in trainer.closing_summary(
      task=tasks.LM, steps=(0, 4), seconds=1.0, evaluations=[],
      final={'eval_loss': 1.0}, tokens_per_s=None, checkpoint=None,
      workdir=workdir, extendable=False, cannot_decode=None)
  assert checkpoint_steps(workdir) == [2, 4]
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['num_train_steps'] == 4

  config.num_train_steps = 6
  run()
  lines = read_metrics(workdir)
  assert [line['step'] for line in lines] == [2, 4, 6]
  for line in lines:
    assert TRAIN_KEYS | EVAL_KEYS[name] <= set(line)
    assert 0 < line['mfu'] < 1
  assert checkpoint_steps(workdir) == [2, 4, 6]


@pytest.mark.core
def test_the_closing_summary_offers_no_decoder_that_cannot_serve_the_run():
  refusal = decoding.cache_refusal(ModelConfig(attention='dense,strided'))
  summary = trainer.closing_summary(
      task=tasks.LM, steps=(0, 4), seconds=1.0, evaluations=[],
      final={'eval_loss': 1.0}, tokens_per_s=None, checkpoint=None,
      workdir='w', extendable=False, cannot_decode=refusal)
  assert summary.endswith(
      'python -m train.generate does not apply: '
      "config.model.attention='strided' cannot decode with a cache "
      '(additive, chunked, deltanet, dense, gated_deltanet, gla, local, '
      'mamba2, mla and retnet can).')
  assert decoding.cache_refusal(ModelConfig(attention='chunked')) is None


@pytest.mark.core
def test_a_run_says_whether_its_corpus_is_its_tracks():
  corpus, other = 'a' * 64, 'b' * 64
  assert trainer.corpus_line(None, corpus) is None  # No fingerprint.
  assert trainer.corpus_line(corpus, '') == f'Corpus sha256 {corpus}.'
  assert trainer.corpus_line(corpus, corpus) == (
      f'Corpus sha256 {corpus}: on the track (config.track_corpus).')
  assert trainer.corpus_line(other, corpus) == (
      f'Corpus sha256 {other}: off the track, whose corpus is '
      f'config.track_corpus={corpus}; these figures are not comparable with '
      'its records.')
  summary = trainer.closing_summary(
      task=tasks.LM, steps=(0, 4), seconds=1.0, evaluations=[],
      final={'eval_loss': 1.0}, tokens_per_s=None, checkpoint=None,
      workdir='w', extendable=True, cannot_decode=None,
      corpus=trainer.corpus_line(other, corpus))
  assert summary.splitlines()[1].startswith(f'Corpus sha256 {other}: off')


def summary_of(steps, *, extendable):
  return trainer.closing_summary(
      task=tasks.LM, steps=steps, seconds=1.0, evaluations=[],
      final={'eval_loss': 1.0}, tokens_per_s=None,
      checkpoint='w/checkpoints/4', workdir='w', extendable=extendable,
      cannot_decode=None)


@pytest.mark.core
@pytest.mark.parametrize('steps', [(0, 4), (4, 4)])
def test_the_closing_summary_says_the_run_is_complete_and_how_to_extend_it(
    steps):
  """Nothing is left to resume: a larger num_train_steps extends a run
  where its schedule allows it, else a new workdir starts from it."""
  assert summary_of(steps, extendable=True).endswith(
      'Last checkpoint: w/checkpoints/4; the run is complete: to train it '
      'further, run the same command with a larger '
      'config.num_train_steps; sample: python -m train.generate '
      '--workdir=w.')
  assert summary_of(steps, extendable=False).endswith(
      'the run is complete: its schedule ends at config.num_train_steps, so '
      'to train it further, start a new --workdir from it with '
      '--config.init_from=w; sample: python -m train.generate --workdir=w.')
  for extendable in (True, False):
    assert 'resume' not in summary_of(steps, extendable=extendable)


@pytest.mark.core
def test_the_closing_summary_of_a_run_trained_before_says_so():
  assert summary_of((4, 4), extendable=True).startswith(
      'Already trained to step 4, evaluated again in 1s; eval_loss 1.')
  assert summary_of((0, 4), extendable=True).startswith(
      'Done: steps 0-4 in 1s; eval_loss 1')


def transformer_xl_config(data_dir):
  """lm_stdlib with a Transformer-XL memory, reading document streams."""
  config = tiny_config('lm_stdlib', data_dir)
  config.pack_sequences = False
  # The smear reads the predecessor's embedding, which a memory does not
  # keep.
  config.model.update(memory_length=16, position='rope', smear=False)
  return config


@pytest.mark.slow
def test_a_resumed_memory_repeats_the_uninterrupted_run(data_dir, tmp_path):
  """A Transformer-XL memory, the data order of document streams, dropout
  and Muon's state continue exactly where the checkpoint left them. (Runs
  of packed rows killed and resumed are test_reliability's.)"""
  def config(steps):
    config = transformer_xl_config(data_dir)
    # A constant rate: the cosine schedule depends on num_train_steps.
    config.update(num_train_steps=steps, log_every=1, checkpoint_every=3,
                  eval_every=0, schedule='constant')
    config.model.dropout_rate = 0.1
    return config

  straight = str(tmp_path / 'straight')
  train_and_evaluate(config(6), straight)
  interrupted = str(tmp_path / 'interrupted')
  train_and_evaluate(config(3), interrupted)
  train_and_evaluate(config(6), interrupted)

  def losses(workdir):
    return [(line['step'], line['loss'], line['grad_norm'])
            for line in read_metrics(workdir)]
  assert losses(interrupted) == losses(straight)


@pytest.mark.core
def test_calls_run_steps_per_call_steps_from_each_multiple_of_it():
  """(the step before, steps) of each call: one at a time up to the first
  multiple (a run resumed at another steps_per_call) and after the last."""
  assert list(trainer.calls(0, 8, 4)) == [(0, 4), (4, 4)]
  assert list(trainer.calls(3, 13, 4)) == [(3, 1), (4, 4), (8, 4), (12, 1)]
  assert list(trainer.calls(0, 3, 4)) == [(0, 1), (1, 1), (2, 1)]
  assert list(trainer.calls(5, 7, 1)) == [(5, 1), (6, 1)]
  # No call crosses a stop (a window schedule's boundary).
  assert list(trainer.calls(0, 12, 4, (2, 8))) == [
      (0, 1), (1, 1), (2, 1), (3, 1), (4, 4), (8, 4)]
