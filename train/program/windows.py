"""config.window_schedule: the longest sliding windows of a model growing
during training (the modded-nanogpt records), at fixed step boundaries.

A model's windowed layers are those whose attention takes a `window`
option (`local`); its long windows are the largest of theirs. With
'local,local' and windows (256, 64), the long layers alternate with short
ones. The schedule ((300, 64), (600, 128)) trains the long layers with
window 64 before step 300, 128 before step 600, and the model's own 256
from there on: the model as configured is the one trained last, evaluated
and sampled. Each window is a program of its own, compiled once; a resumed
run takes up the window of its step.
"""

import dataclasses
import inspect

from model import attention
from model.config import ModelConfig
from train.base.train_config import TrainConfig

WINDOW = 'window'


def _windows(model_config: ModelConfig) -> list[int | None]:
  """Each attention entry's window (its option, else its function's
  default), None where it takes none."""
  windows = []
  for layer_config in model_config.layer_configs():
    signature = inspect.signature(attention.get(layer_config.attention))
    if WINDOW not in signature.parameters:
      windows.append(None)
      continue
    windows.append(dict(layer_config.attention_options).get(
        WINDOW, signature.parameters[WINDOW].default))
  return windows


def long_window(model_config: ModelConfig) -> int | None:
  """The largest window of the model's windowed layers; None for none."""
  windows = [window for window in _windows(model_config)
             if window is not None]
  return max(windows) if windows else None


def with_long_window(model_config: ModelConfig, window: int) -> ModelConfig:
  """The model with its long windows (long_window's) `window`."""
  longest = long_window(model_config)
  entries = []
  for entry_window, layer_config in zip(_windows(model_config),
                                        model_config.layer_configs()):
    options = dict(layer_config.attention_options)
    if entry_window == longest:
      options[WINDOW] = window
    entries.append(tuple(sorted(options.items())))
  options = (tuple(entries) if isinstance(model_config.attention, tuple)
             else entries[0])
  return dataclasses.replace(model_config, attention_options=options)


def window_at(config: TrainConfig, step: int) -> int | None:
  """The long window of the step after `step` (steps done), or None where
  it is the model's own."""
  for until, window in config.window_schedule:
    if step < until:
      return window
  return None


def boundaries(config: TrainConfig) -> tuple[int, ...]:
  """The steps at which the window changes."""
  return tuple(until for until, _ in config.window_schedule)


def problem(config: TrainConfig) -> str | None:
  """What is wrong with config.window_schedule for this model, or None."""
  schedule = config.window_schedule
  if not schedule:
    return None
  key = f'config.window_schedule={schedule!r}'
  longest = long_window(config.model)
  if longest is None:
    return (f'{key} grows the windows of windowed attention (local); '
            f'config.model.attention={config.model.attention!r} has none.')
  steps = [until for until, _ in schedule]
  windows = [window for _, window in schedule] + [longest]
  if not 0 < steps[0] or steps != sorted(set(steps)) or (
      steps[-1] >= config.num_train_steps):
    return (f'{key}: its steps must increase from above 0 to below '
            f'config.num_train_steps={config.num_train_steps}.')
  if windows != sorted(set(windows)) or windows[0] < 1:
    return (f'{key}: its windows must grow, each positive and below the '
            f"model's long window, {longest}.")
  return None


def describe(config: TrainConfig) -> str | None:
  """The start-up line of a schedule, or None without one."""
  if not config.window_schedule:
    return None
  stages = ', '.join(f'{window} before step {until}'
                     for until, window in config.window_schedule)
  return (f'Long windows: {stages}, then {long_window(config.model)}; a '
          'program compiled for each.')

