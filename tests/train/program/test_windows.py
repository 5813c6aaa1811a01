"""config.window_schedule (train/program/windows.py): which windows grow,
and when."""

import pytest

from model.config import ModelConfig
from train.base.train_config import TrainConfig
from train.program import windows


@pytest.mark.core
def test_the_long_windows_are_the_largest_and_only_they_change():
  alternating = ModelConfig(attention='local,local', attention_options={
      'local': {'window': (256, 64)}})
  assert windows.long_window(alternating) == 256
  grown = windows.with_long_window(alternating, 128)
  assert [dict(layer.attention_options)['window']
          for layer in grown.layer_configs()] == [128, 64]
  # A local layer without the option has its function's default, 128.
  mixed = ModelConfig(attention='dense,local')
  assert windows.long_window(mixed) == 128
  assert [dict(layer.attention_options) for layer in windows.with_long_window(
      mixed, 32).layer_configs()] == [{}, {'window': 32}]
  assert windows.long_window(ModelConfig(attention='dense')) is None


@pytest.mark.core
def test_each_step_trains_with_its_stages_window():
  config = TrainConfig(num_train_steps=1000, window_schedule=(
      (300, 64), (600, 128)), model=ModelConfig(
          attention='local', attention_options={'window': 256}))
  assert [windows.window_at(config, step) for step in (0, 299, 300, 599,
                                                       600, 999)] == [
      64, 64, 128, 128, None, None]
  assert windows.boundaries(config) == (300, 600)
  assert windows.problem(config) is None
  assert windows.describe(config) == (
      'Long windows: 64 before step 300, 128 before step 600, then 256; a '
      'program compiled for each.')


@pytest.mark.core
@pytest.mark.parametrize('schedule, says', [
    (((600, 64), (300, 128)), 'its steps must increase'),
    (((300, 64), (1000, 128)), 'below config.num_train_steps=1000'),
    (((300, 128), (600, 64)), 'its windows must grow'),
    (((300, 256),), "below the model's long window, 256"),
])
def test_a_schedule_that_does_not_grow_in_time_is_refused(schedule, says):
  config = TrainConfig(num_train_steps=1000, window_schedule=schedule,
                       model=ModelConfig(attention='local',
                                         attention_options={'window': 256}))
  assert says in windows.problem(config)
