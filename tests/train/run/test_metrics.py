"""metrics.jsonl survives its writers: strict JSON, a cut last line moved
aside, a bad line skipped by readers and reported."""

import json
import math
import pathlib
import struct
import time
import types

import numpy as np
import pytest
from tensorboardX.proto import event_pb2, plugin_hparams_pb2

from experiments import common
from train.run import metrics


@pytest.mark.core
def test_non_finite_values_are_written_as_strict_json_and_read_back():
  text = metrics.json_line(5, {'loss': 1.5, 'grad_norm': math.nan,
                               'scale': -math.inf})
  line = json.loads(text, parse_constant=lambda name: 1 / 0)  # Strict.
  assert line == {'step': 5, 'loss': 1.5, 'grad_norm': None, 'scale': None,
                  'non_finite': {'grad_norm': 'nan', 'scale': '-inf'}}


@pytest.mark.core
def test_a_cut_last_line_is_moved_aside_before_the_next_run_writes(
    tmp_path, capsys):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
  writer = metrics.MetricWriter(str(tmp_path), total_steps=4, first_step=2)
  writer.write(3, {'loss': 1.0, 'grad_norm': math.nan})
  writer.close()
  assert 'was cut off' in capsys.readouterr().out
  assert (tmp_path / 'metrics.jsonl.partial').read_text() == (
      '{"step": 2, "lo\n')
  [first, third] = common.read_metrics(str(tmp_path))
  assert first == {'step': 1, 'loss': 2.0}
  assert third['step'] == 3 and math.isnan(third['grad_norm'])


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
  log = metrics.TrainLog(types.SimpleNamespace(advance=lambda: None),
                         log_every=2, last_step=2,
                         guard=metrics.NonFiniteGuard('stop', 0))
  stacked = {'loss_sum': np.array([4.0, 2.0]),
             'correct_sum': np.array([1.0, 3.0]),
             'weight_sum': np.array([4.0, 4.0]),
             'token_count': np.array([8.0, 8.0]),
             'learning_rate': np.array([0.1, 0.2]),
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
  assert summary['steps_per_s'] == 2 / 3.0
  assert summary['tokens_per_s'] == 16 / 3.0
