"""metrics.jsonl survives its writers: strict JSON, a cut last line moved
aside, a bad line skipped by readers and reported."""

import json
import math
import pathlib
import struct
import time
import types
from typing import Callable

import gcsfs
import numpy as np
import pytest
from tensorboardX.proto import event_pb2, plugin_hparams_pb2

from experiments import common
from tests.helpers.tiny_runs import tiny_config
from train import train
from train.base import storage
from train.run import metrics


@pytest.mark.core
def test_non_finite_values_are_written_as_strict_json_and_read_back():
  text = metrics.json_line(5, {'loss': 1.5, 'grad_norm': math.nan,
                               'scale': -math.inf})
  line = json.loads(text, parse_constant=lambda name: 1 / 0)  # Strict.
  assert line == {'step': 5, 'loss': 1.5, 'grad_norm': None, 'scale': None,
                  'non_finite': {'grad_norm': 'nan', 'scale': '-inf'}}


@pytest.fixture
def bucket_workdir(object_store, tmp_path, monkeypatch) -> str:
  """A workdir in the emulator's bucket, TensorBoard's events written to a
  local directory: tensorboardX uploads each event file once more when
  the process exits, after the emulator has."""
  tensorboard = metrics.tensorboardX.SummaryWriter
  local = str(tmp_path / 'tensorboard')
  monkeypatch.setattr(metrics.tensorboardX, 'SummaryWriter',
                      lambda logdir: tensorboard(local))
  return f'{object_store}/{tmp_path.name}'


@pytest.fixture(params=[pytest.param('disk', marks=pytest.mark.core),
                        'object store'])
def workdir(request, tmp_path) -> str:
  """A workdir on a disk (in the quick tier), or in the emulator's
  bucket."""
  if request.param == 'disk':
    return str(tmp_path)
  return request.getfixturevalue('bucket_workdir')


def test_a_cut_last_line_is_moved_aside_before_the_next_run_writes(
    workdir, capsys):
  path = storage.path(workdir) / 'metrics.jsonl'
  storage.write_whole(path, '{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
  writer = metrics.MetricWriter(workdir, total_steps=4, first_step=2)
  writer.write(3, {'loss': 1.0, 'grad_norm': math.nan})
  assert writer.close() is None
  assert 'was cut off' in capsys.readouterr().out
  assert (storage.path(workdir) / 'metrics.jsonl.partial').read_text() == (
      '{"step": 2, "lo\n')
  [first, third] = metrics.read_metrics(str(path))
  assert first == {'step': 1, 'loss': 2.0}
  assert third['step'] == 3 and math.isnan(third['grad_norm'])


def unavailable(refused: Callable[[int], bool]) -> Callable:
  """storage.write_whole, but a 503 (as gcsfs raises it) for an upload of
  metrics.jsonl whose count of lines is `refused`."""
  write_whole = storage.write_whole

  def write_whole_or_fail(file, data):
    if file.name == 'metrics.jsonl' and refused(data.count('\n')):
      raise gcsfs.retry.HttpError({'code': 503,
                                   'message': 'Service Unavailable'})
    write_whole(file, data)
  return write_whole_or_fail


def test_metrics_the_store_refused_are_uploaded_at_the_next_flush(
    bucket_workdir, monkeypatch, capsys):
  """The first upload of metrics.jsonl refused (a 503): said once, its
  line kept and uploaded by the next flush, every line there at the end."""
  monkeypatch.setattr(storage, 'write_whole',
                      unavailable(lambda lines: lines == 1))
  writer = metrics.MetricWriter(bucket_workdir, total_steps=3, first_step=0)
  for step in (1, 2, 3):
    writer.write(step, {'loss': 1.0 / step})
    writer.flush()
  assert writer.close() is None
  [said] = [line for line in capsys.readouterr().out.splitlines()
            if 'could not write' in line]
  assert said == (f'warning: could not write {bucket_workdir}/metrics.jsonl '
                  '(Service Unavailable, 503); its lines are kept, and '
                  'uploaded again at the next flush.')
  assert [line['step'] for line in metrics.read_metrics(
      f'{bucket_workdir}/metrics.jsonl')] == [1, 2, 3]


def test_metrics_the_store_refuses_at_the_end_are_named_as_lost(
    bucket_workdir, monkeypatch):
  """Every upload after step 1's refused: the close says in one line
  which summaries are lost; the store keeps step 1's."""
  monkeypatch.setattr(storage, 'write_whole',
                      unavailable(lambda lines: lines > 1))
  writer = metrics.MetricWriter(bucket_workdir, total_steps=3, first_step=0)
  for step in (1, 2, 3):
    writer.write(step, {'loss': 1.0 / step})
    writer.flush()
  assert writer.close() == (
      f'could not write {bucket_workdir}/metrics.jsonl at the end of the run '
      '(Service Unavailable, 503): its last 2 lines, the summaries of steps '
      '2-3 shown above, are lost.')
  assert [line['step'] for line in metrics.read_metrics(
      f'{bucket_workdir}/metrics.jsonl')] == [1]


def test_a_run_whose_last_metrics_the_store_refuses_exits_1(
    data_dir, bucket_workdir, monkeypatch, capsys):
  """A tiny run on gs:// whose store refuses metrics.jsonl once it holds
  step 4's line: trained to the end, then exit status 1 and one line
  naming the summary lost."""
  monkeypatch.setattr(storage, 'write_whole',
                      unavailable(lambda lines: lines > 1))
  config = tiny_config('lm_stdlib', data_dir)
  config.sample_length = 0
  with pytest.raises(SystemExit) as exit_:
    train.run(config, bucket_workdir)
  assert exit_.value.code == 1
  assert capsys.readouterr().err.splitlines()[-1] == (
      f'error: could not write {bucket_workdir}/metrics.jsonl at the end of '
      'the run (Service Unavailable, 503): its last line, the summary of '
      'step 4 shown above, is lost.')
  assert [line['step'] for line in metrics.read_metrics(
      f'{bucket_workdir}/metrics.jsonl')] == [2]


def test_readers_skip_and_report_a_bad_line(tmp_path, capsys):
  (tmp_path / 'metrics.jsonl').write_bytes(
      b'{"step": 1, "loss": 2.0}\n\x00\xff\xfegarbage\n[1, 2]\n'
      b'{"step": 3, "non_finite": 7}\n{"step": 2, "loss": 1.0}\n')
  assert [line['step'] for line in common.read_metrics(str(tmp_path))] == [
      1, 2]
  error = capsys.readouterr().err
  for number in (2, 3, 4):
    assert f'line {number} is not a metrics summary' in error


def tensorboard_events(directory) -> list:
  """The events of every event file under `directory` (TFRecord framing:
  length, its CRC, the Event proto, its CRC)."""
  events = []
  for path in sorted(pathlib.Path(directory).rglob('events.out.tfevents.*')):
    data = path.read_bytes()
    while data:
      length = struct.unpack('<Q', data[:8])[0]
      events.append(event_pb2.Event.FromString(data[12:12 + length]))
      data = data[16 + length:]
  return events


def test_tensorboard_tags_are_grouped_and_hparams_written(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path), total_steps=2, first_step=0)
  writer.write(2, {'loss': 1.5, 'eval_loss': 1.25,
                   'decode_validation_bleu': 30.0})
  writer.write_hparams(metrics.flat_hparams(
      {'learning_rate': 1e-3, 'model': {'attention': 'dense', 'window': None},
       'decode_splits': ('validation',)}), {'eval_loss': 1.25})
  writer.close()
  values = [value for event in tensorboard_events(tmp_path / 'tensorboard')
            for value in event.summary.value]
  scalars = {value.tag: value.simple_value for value in values
             if value.HasField('simple_value')}
  assert scalars == {'train/loss': 1.5, 'eval/loss': 1.25,
                     'decode/validation_bleu': 30.0}
  [start] = [value for value in values
             if value.tag == '_hparams_/session_start_info']
  hparams = plugin_hparams_pb2.HParamsPluginData.FromString(
      start.metadata.plugin_data.content).session_start_info.hparams
  assert hparams['learning_rate'].number_value == 1e-3
  assert hparams['model.attention'].string_value == 'dense'
  assert hparams['decode_splits'].string_value == "('validation',)"
  assert 'model.window' not in hparams
  # The final evaluation, beside the hparams, under the same tag.
  assert ('eval/loss', 1.25) in [
      (value.tag, value.simple_value) for event in tensorboard_events(
          tmp_path / 'tensorboard' / 'hparams')
      for value in event.summary.value]


@pytest.mark.core
def test_a_call_of_several_steps_is_logged_by_step_and_pauses_are_left_out(
    monkeypatch):
  """Two steps in one call (stacked metrics): each counted, the interval
  summarised at its last; the 10 s paused (an evaluation, a compilation)
  are not in the throughput."""
  now = [0.0]
  monkeypatch.setattr(metrics, 'time', types.SimpleNamespace(
      perf_counter=lambda: now[0], time=time.time))
  log = metrics.TrainLog(types.SimpleNamespace(advance=lambda steps: None),
                         log_every=2, last_step=2,
                         guard=metrics.NonFiniteGuard('stop', 0))
  stacked = {'loss_sum': np.array([4.0, 2.0]),
             'correct_sum': np.array([1.0, 3.0]),
             'weight_sum': np.array([4.0, 4.0]),
             'token_count': np.array([8.0, 8.0]),
             'learning_rate': np.array([0.1, 0.2]),
             'muon_learning_rate': np.array([1.0, 2.0]),
             'grad_norm': np.array([1.0, 0.5])}
  now[0] = 1.0
  assert log.add(2, stacked, count=2) is None
  log.pause()
  now[0] = 11.0
  log.resume()
  now[0] = 13.0
  step, summary = log.complete()
  assert step == 2
  assert summary['loss'] == 6.0 / 8.0 and summary['accuracy'] == 0.5
  assert (summary['learning_rate'], summary['grad_norm']) == (0.2, 0.5)
  assert summary['muon_learning_rate'] == 2.0
  assert summary['steps_per_s'] == 2 / 3.0
  assert summary['tokens_per_s'] == 16 / 3.0


@pytest.mark.core
def test_the_guard_checks_each_step_of_a_call_in_order():
  """Stacked calls of 4 steps: the first non-finite step is named (its
  first non-finite metric); skips in a row are counted across calls."""
  guard = metrics.NonFiniteGuard('stop', 0)
  guard.check(1, {'loss_sum': np.ones(4), 'grad_norm': np.ones(4)})
  with pytest.raises(metrics.NonFiniteStop, match=(
      r"step 6: the gradient norm is inf \(config.nan_policy='stop'\)")):
    guard.check(5, {'loss_sum': np.array([1.0, 1.0, np.nan, 1.0]),
                    'grad_norm': np.array([1.0, np.inf, 1.0, 1.0])})
  guard = metrics.NonFiniteGuard('skip', 2)
  guard.check(1, {'skipped': np.array([0.0, 1.0, 1.0, 0.0])})
  guard.check(5, {'skipped': np.array([0.0, 0.0, 1.0, 1.0])})
  with pytest.raises(metrics.NonFiniteStop, match=(
      r'steps 7-9: 3 updates in a row .* config.max_skipped_steps=2')):
    guard.check(9, {'skipped': np.array([1.0, 0.0, 0.0, 0.0])})


def one_step(loss: float) -> dict:
  return {'loss_sum': loss, 'correct_sum': 1.0, 'weight_sum': 1.0,
          'token_count': 1.0, 'learning_rate': 0.1, 'grad_norm': 1.0}


@pytest.mark.core
def test_a_summary_of_fewer_steps_than_log_every_says_how_many():
  """Resumed after step 3 of intervals of 2: the line of step 4 averages
  step 4 alone, and says so; a whole interval's line needs no mark."""
  log = metrics.TrainLog(types.SimpleNamespace(advance=lambda steps: None),
                         log_every=2, last_step=6,
                         guard=metrics.NonFiniteGuard('stop', 0))
  logged = [log.add(step, one_step(float(step))) for step in (4, 5, 6)]
  logged.append(log.complete())
  [(first, resumed), (second, whole)] = [line for line in logged if line]
  assert (first, second) == (4, 6)
  assert resumed['loss'] == 4.0 and resumed['steps_averaged'] == 1
  assert whole['loss'] == (5.0 + 6.0) / 2 and 'steps_averaged' not in whole


def test_a_step_logged_again_by_a_resumed_run_is_read_once(tmp_path):
  """Killed after step 6, resumed from step 5: the resumed run's line of
  step 6 averages one step and says so, and replaces the first run's."""
  (tmp_path / 'metrics.jsonl').write_text(
      '{"step": 6, "loss": 2.0}\n{"step": 6, "eval_loss": 1.5}\n'
      '{"step": 6, "loss": 3.0, "steps_averaged": 1}\n')
  assert common.read_metrics(str(tmp_path)) == [
      {'step': 6, 'eval_loss': 1.5},
      {'step': 6, 'loss': 3.0, 'steps_averaged': 1}]
