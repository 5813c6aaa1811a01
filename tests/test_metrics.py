"""metrics.jsonl survives its writers: strict JSON, a cut last line moved
aside, a bad line skipped by readers and reported."""

import json
import math

from experiments import common
from train import metrics


def test_non_finite_values_are_written_as_strict_json_and_read_back():
  text = metrics.json_line(5, {'loss': 1.5, 'grad_norm': math.nan,
                               'scale': -math.inf})
  line = json.loads(text, parse_constant=lambda name: 1 / 0)  # Strict.
  assert line == {'step': 5, 'loss': 1.5, 'grad_norm': None, 'scale': None,
                  'non_finite': {'grad_norm': 'nan', 'scale': '-inf'}}


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
