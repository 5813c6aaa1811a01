"""Metrics: summaries of metric sums, and where they are written.

Every summary goes to `workdir/metrics.jsonl` (one JSON object a line,
flushed as written, so `tail -f` follows a run and a killed run keeps every
line), to TensorBoard event files under `workdir/tensorboard`, and to the
terminal. The lines are strict JSON: a value that is not finite (the
gradient norm of a skipped step) is written as null, and the line's
`non_finite` object holds it as a string ({"grad_norm": "nan"}), which
`read_metrics` turns back into the float. A line cut by a killed writer or
a full disk is moved to `metrics.jsonl.partial` when the next run starts.
In a workdir on an object store, metrics.jsonl and TensorBoard's event
file are uploaded whole (train/base/storage.py; tensorboardX's own writer),
so no line there is ever cut: at most every UPLOAD_EVERY_S seconds (GCS
takes about one write of an object a second), before each checkpoint and
at the end. A run killed there loses the lines of its last seconds, all
after its last checkpoint, which the resumed run logs again. An upload
the store refuses keeps its lines for the next; lines still unwritten at
the end fail the run (exit status 1), named in one line.
"""

import functools
import json
import math
import operator
import sys
import time
from typing import Any

import jax
import numpy as np
import tensorboardX
import tqdm

from train.base import storage
from train.base.errors import Stopped, TrainingError

LN2 = math.log(2.0)
# Seconds between uploads of the metrics to an object store.
UPLOAD_EVERY_S = 10.0


def is_due(step: int, every: int, last_step: int) -> bool:
  """Whether a periodic action (log, eval, checkpoint) runs after `step`:
  every `every` steps (never if `every` <= 0) and after the last step."""
  return step == last_step or (every > 0 and step % every == 0)


def final_summary(task, decode_splits=()) -> dict[str, str | None]:
  """The figures a run of a `task` (train/data/tasks.py) may log at its last
  step, each with the direction that is better ('min' or 'max'; None for
  neither): the training summary, then the evaluation's."""
  names = {'loss': 'min', 'accuracy': 'max', 'learning_rate': None,
           'muon_learning_rate': None, 'grad_norm': None, 'tokens_per_s': 'max', 'steps_per_s': 'max',
           'mfu': 'max', 'steps_averaged': None, 'skipped_steps': 'min',
           'moe_aux_loss': 'min', 'moe_dropped_fraction': 'min',
           'eval_loss': 'min', 'eval_accuracy': 'max'} | dict(task.quality)
  for split in decode_splits:
    for score in ('exact_match', 'token_accuracy', 'bleu'):
      names[f'decode_{split}_{score}'] = 'max'
  return names


def summarize_train(sums: dict[str, float]) -> dict[str, float]:
  weight = max(sums['weight_sum'], 1.0)
  summary = {'loss': sums['loss_sum'] / weight,
             'accuracy': sums['correct_sum'] / weight}
  if 'skipped' in sums:
    summary['skipped_steps'] = sums['skipped']
  if 'moe_aux_loss_sum' in sums:
    summary['moe_aux_loss'] = sums['moe_aux_loss_sum'] / weight
    summary['moe_dropped_fraction'] = (sums['moe_dropped']
                                       / max(sums['moe_assigned'], 1.0))
  return summary


class NonFiniteStop(TrainingError):
  """A step's loss or gradient was not finite and config.nan_policy says
  stop (or too many steps in a row were skipped)."""


class NonFiniteGuard:
  """Applies config.nan_policy to the metrics of each completed step.

  stop: raise NonFiniteStop naming the step and the first non-finite
  metric. skip: the step dropped its update (train.program.steps.train_step) and
  reported `skipped`; raise once more than `max_skipped_steps` in a row
  were skipped.
  """

  # Metrics in the order they are checked, and their names in messages.
  _CHECKED = (('loss_sum', 'loss'), ('grad_norm', 'gradient norm'))

  def __init__(self, policy: str, max_skipped_steps: int):
    self._policy, self._max_skipped = policy, max_skipped_steps
    self._skipped_in_a_row = 0

  @property
  def skips(self) -> bool:
    """Whether steps report `skipped` (train_step's skip_nonfinite)."""
    return self._policy == 'skip'

  def check(self, first_step: int, values: dict[str, np.ndarray]) -> None:
    """The policy applied to consecutive steps from `first_step`, each
    metric an array of their values [steps]."""
    if self.skips:
      skipped = values['skipped']
      if not skipped.any():
        self._skipped_in_a_row = 0
        return
      for step, flag in enumerate(skipped.tolist(), start=first_step):
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if flag else 0
        if self._skipped_in_a_row > self._max_skipped:
          raise NonFiniteStop(
              f'steps {step - self._skipped_in_a_row + 1}-{step}: '
              f'{self._skipped_in_a_row} updates in a row had a non-finite '
              f'loss or gradient and were skipped, more than config.'
              f'max_skipped_steps={self._max_skipped}.')
      return
    finite = [np.isfinite(values[key]) for key, _ in self._CHECKED]
    if np.logical_and.reduce(finite).all():
      return
    index = int(np.argmin(np.logical_and.reduce(finite)))
    key, name = next(checked for checked, ok in zip(self._CHECKED, finite)
                     if not ok[index])
    raise NonFiniteStop(
        f'step {first_step + index}: the {name} is '
        f"{float(values[key][index])} (config.nan_policy='stop').")


def summarize_eval(sums: dict[str, float], *, byte_level: bool
                   ) -> dict[str, float]:
  """eval_loss (nats per target), eval_accuracy, and where they apply
  eval_bits_per_byte and eval_exact_match."""
  weight = max(sums['weight_sum'], 1.0)
  summary = {'eval_loss': sums['nll_sum'] / weight,
             'eval_accuracy': sums['correct_sum'] / weight}
  if byte_level:
    summary['eval_bits_per_byte'] = summary['eval_loss'] / LN2
  if 'exact_match_sum' in sums:
    summary['eval_exact_match'] = (sums['exact_match_sum']
                                   / max(sums['example_count'], 1.0))
  return summary


def json_line(step: int, summary: dict[str, float]) -> str:
  """The strict-JSON line of a summary (see the module's docstring)."""
  line = {'step': step} | {key: value if math.isfinite(value) else None
                           for key, value in summary.items()}
  non_finite = {key: str(value) for key, value in summary.items()
                if not math.isfinite(value)}
  if non_finite:
    line['non_finite'] = non_finite
  return json.dumps(line, allow_nan=False) + '\n'


def read_metrics(path: str) -> list[dict[str, float]]:
  """The summaries of a metrics.jsonl, non-finite values restored; a line
  that is not a summary is skipped with a warning naming it."""
  summaries = []
  # Bytes that are not UTF-8 (disk garbage) spoil their line only.
  lines = storage.path(path).read_bytes().decode('utf-8', errors='replace')
  for number, text in enumerate(lines.split('\n'), start=1):
    if not text.strip():
      continue
    try:
      line = json.loads(text)
      if not isinstance(line, dict) or 'step' not in line:
        raise ValueError('no step')
      for key, value in line.pop('non_finite', {}).items():
        line[key] = float(value)
    except (ValueError, TypeError, AttributeError):
      print(f'warning: {path} line {number} is not a metrics summary; '
            f'skipped: {text.strip()[:80]!r}', file=sys.stderr, flush=True)
      continue
    summaries.append(line)
  return summaries


def repair_cut_line(path: str) -> None:
  """Moves a last line without its newline (its writer was killed, or the
  disk filled; on an object store, a file written whole by another tool)
  to `<path>.partial`, and says so."""
  file = storage.path(path)
  if not file.exists():
    return
  data = file.read_bytes()
  if not data or data.endswith(b'\n'):
    return
  cut = data.rfind(b'\n') + 1
  partial = storage.path(path + '.partial')
  # Set aside before it is cut off: a failure in between loses nothing.
  storage.write_whole(partial, (partial.read_bytes() if partial.exists()
                                else b'') + data[cut:] + b'\n')
  storage.write_whole(file, data[:cut])
  print(f'warning: the last line of {path} was cut off (its writer was '
        f'killed, or ran out of room); it is moved to {path}.partial.',
        flush=True)


def tensorboard_tag(key: str) -> str:
  """A summary's key as a TensorBoard tag, grouped by where it comes from:
  eval_loss -> eval/loss, decode_validation_bleu -> decode/validation_bleu,
  loss -> train/loss."""
  group, _, name = key.partition('_')
  return f'{group}/{name}' if group in ('eval', 'decode') else f'train/{key}'


def flat_hparams(config: dict, prefix: str = '') -> dict[str, Any]:
  """A config as {dotted key: value}, each value a number, a bool or a
  string (TensorBoard's HParams types); None values left out."""
  flat = {}
  for key, value in config.items():
    if isinstance(value, dict):
      flat |= flat_hparams(value, f'{prefix}{key}.')
    elif value is not None:
      flat[prefix + key] = (value if isinstance(value, (bool, int, float, str))
                            else str(value))
  return flat


class MetricWriter:
  """Writes summaries from process 0; a no-op on the other hosts."""

  def __init__(self, workdir: str, total_steps: int, first_step: int):
    self._active = jax.process_index() == 0
    if not self._active:
      return
    path = f'{workdir}/metrics.jsonl'
    repair_cut_line(path)
    self._jsonl = storage.Lines(path)
    # tensorboardX writes gs:// itself (google-cloud-storage), the event
    # file uploaded whole at each flush.
    self._tensorboard = tensorboardX.SummaryWriter(f'{workdir}/tensorboard')
    # Flushed at each summary on a disk.
    self._flush_every = (UPLOAD_EVERY_S if storage.is_object_store(workdir)
                         else 0.0)
    self._flushed = time.monotonic()
    # The steps of the lines not yet written out, and whether the last try
    # failed (said once, until one succeeds).
    self._unwritten_steps, self._refused = [], False
    self._progress = tqdm.tqdm(total=total_steps, initial=first_step,
                               unit='step', dynamic_ncols=True)

  def write(self, step: int, summary: dict[str, float]) -> None:
    if not self._active:
      return
    summary = {key: float(value) for key, value in summary.items()}
    if self._jsonl is not None:
      try:
        # The wall-clock time, in seconds since the epoch, in the file only.
        self._jsonl.write(json_line(step, summary | {'time': time.time()}))
        self._unwritten_steps.append(step)
      except OSError as error:  # A full disk, a lost mount.
        self._stop_jsonl(f'could not write the metrics of step {step} to '
                         f'{self._jsonl.name} ({error.strerror or error})')
    for key, value in summary.items():
      self._tensorboard.add_scalar(tensorboard_tag(key), value, step)
    if time.monotonic() - self._flushed >= self._flush_every:
      self.flush()
    shown = ', '.join(f'{key} {value:.4g}' for key, value in summary.items())
    self._progress.write(f'step {step}: {shown}')

  def flush(self) -> None:
    """Writes out what is written so far (before a checkpoint); a failure
    is said, training goes on, and the lines are written at the next try."""
    if not self._active:
      return
    self._flushed = time.monotonic()
    if self._jsonl is not None:
      try:
        self._jsonl.flush()
      except Stopped:  # The workdir's lease lapsed (storage.bounded).
        raise
      except Exception as error:  # pylint: disable=broad-except
        # Any error of the store (gcsfs's are not all OSErrors).
        if not self._refused:
          print(f'warning: could not write {self._jsonl.name} '
                f'({storage.reason(error)}); its lines are kept, and '
                'uploaded again at the next flush.', flush=True)
        self._refused = True
      else:
        self._unwritten_steps, self._refused = [], False
    self._on_tensorboard('flush')

  def _on_tensorboard(self, action: str) -> None:
    """Flushes or closes TensorBoard's writer, within the store's time
    bound; a failure is said."""
    try:
      storage.bounded(getattr(self._tensorboard, action),
                      self._tensorboard.logdir)
    except Stopped:
      raise
    except Exception as error:  # pylint: disable=broad-except
      print(f"warning: could not write TensorBoard's events ({error}).",
            flush=True)

  def _stop_jsonl(self, problem: str) -> None:
    """Closes metrics.jsonl on a disk that could not take a line, and says
    so (`problem`). Training goes on, and the other hosts need not know:
    checkpoints check their own writes."""
    jsonl, self._jsonl = self._jsonl, None
    try:
      jsonl.close()
    except OSError:  # The line it could not write, failing again.
      pass
    print(f'warning: {problem}; metrics.jsonl is not written any more in '
          'this run.', flush=True)

  def _lost(self, error: Exception) -> str | None:
    """The line saying which summaries the last write of metrics.jsonl,
    failing with `error`, lost; None where every line was written before
    (a disk's, flushed as written: only closing the file failed)."""
    steps = self._unwritten_steps
    if not steps:
      return None
    lines = (f'its last {len(steps)} lines, the summaries of steps '
             f'{steps[0]}-{steps[-1]} shown above, are' if len(steps) > 1
             else f'its last line, the summary of step {steps[0]} shown '
             'above, is')
    return (f'could not write {self._jsonl.name} at the end of the run '
            f'({storage.reason(error)}): {lines} lost.')

  def write_hparams(self, hparams: dict[str, Any],
                    final: dict[str, float]) -> None:
    """The run's config and final evaluation for TensorBoard's HParams
    view, in `tensorboard/hparams`."""
    if self._active:
      self._tensorboard.add_hparams(
          hparams, {tensorboard_tag(key): float(value)
                    for key, value in final.items()}, name='hparams')

  def say(self, message: str) -> None:
    """A status line above the progress bar."""
    if self._active:
      self._progress.write(message)

  def advance(self, steps: int) -> None:
    if self._active:
      self._progress.update(steps)

  def close(self) -> str | None:
    """Writes out and closes; what could not be written (None: all was),
    for the run to fail with once it is done."""
    if not self._active:
      return None
    self._progress.close()
    lost = None
    if self._jsonl is not None:
      try:
        self._jsonl.close()
      except Stopped:
        raise
      except Exception as error:  # pylint: disable=broad-except
        lost = self._lost(error)
    self._on_tensorboard('close')
    return lost


class TrainLog:
  """Training-metric summaries every `log_every` steps, fetched one call
  late. A summary of fewer steps (the first after a resume in the middle
  of an interval, the last of a run) says how many in `steps_averaged`.

  `add` is called right after a call (one step or several) is dispatched;
  it fetches the metrics of the call before, which waits for that call
  only. So the device always has the next call queued, and the host never
  runs more than one call ahead: the progress bar and the throughput are
  what the device does.
  """

  _SUMMED = ('loss_sum', 'correct_sum', 'weight_sum', 'token_count')

  def __init__(self, writer: MetricWriter, log_every: int, last_step: int,
               guard: NonFiniteGuard, *, flops_per_step: float = 0.0,
               peak_flops_per_s: float | None = None):
    self._writer, self._log_every, self._last_step = (writer, log_every,
                                                      last_step)
    self._guard = guard
    # Model FLOPs utilisation, where the devices' peak is known.
    self._mfu_per_step_per_s = (flops_per_step / peak_flops_per_s
                                if peak_flops_per_s else None)
    self._pending = None
    self._summed = self._SUMMED + (('skipped',) if guard.skips else ())
    self._sums = dict.fromkeys(self._summed, 0.0)
    self._steps = 0
    self._interval_start = time.perf_counter()
    self._excluded = 0.0

  def add(self, step: int, metrics: dict,
          count: int = 1) -> tuple[int, dict] | None:
    """Records the dispatched call that ends at `step`: one step, or
    `count` steps whose metrics are stacked [count] (steps_per_call);
    returns (step, summary) of the call before if it ended a logging
    interval."""
    completed = self.complete()
    self._pending = (step, metrics, count)
    return completed

  def complete(self) -> tuple[int, dict] | None:
    """Waits for the last dispatched call (one transfer of its metrics);
    returns (step, summary) if one of its steps ends a logging interval
    (the last one does, where intervals are multiples of its steps). The
    call's steps are checked, summed and counted at once."""
    if self._pending is None:
      return None
    last, metrics, count = self._pending
    self._pending = None
    values = {key: np.reshape(value, count)
              for key, value in jax.device_get(metrics).items()}
    first = last - count + 1
    self._guard.check(first, values)
    self._writer.advance(count)
    completed, start = None, 0
    for step in (step for step in range(first, last + 1)
                 if is_due(step, self._log_every, self._last_step)):
      end = step - first + 1
      self._add(values, start, end)
      completed = self._summary(step, values, end - 1)
      start = end
    self._add(values, start, count)
    return completed

  def _add(self, values: dict[str, np.ndarray], start: int, end: int
           ) -> None:
    """Adds steps [start, end) of a call's metrics to the interval's sums,
    in order (as float64, one step after the other)."""
    if start == end:
      return
    # Mixture-of-experts models also report their routing (moe_*).
    for key in self._summed + tuple(k for k in values
                                    if k.startswith('moe_')):
      self._sums[key] = functools.reduce(
          operator.add, values[key][start:end].tolist(),
          self._sums.get(key, 0.0))
    self._steps += end - start

  def _summary(self, step: int, values: dict[str, np.ndarray],
               index: int) -> tuple[int, dict]:
    """The summary of the interval ending at `step` (the call's step
    `index`), which starts the next interval."""
    seconds = max(time.perf_counter() - self._interval_start
                  - self._excluded, 1e-9)
    summary = summarize_train(self._sums)
    # Each rate the optimizer applies (optim.Optimizer.rates), by name.
    summary.update({key: float(value[index]) for key, value in values.items()
                    if key.endswith('learning_rate')})
    summary['grad_norm'] = float(values['grad_norm'][index])
    summary['tokens_per_s'] = self._sums['token_count'] / seconds
    summary['steps_per_s'] = self._steps / seconds
    if self._steps != self._log_every:
      summary['steps_averaged'] = self._steps
    if self._mfu_per_step_per_s is not None:
      summary['mfu'] = self._mfu_per_step_per_s * summary['steps_per_s']
    self._sums = dict.fromkeys(self._summed, 0.0)
    self._steps = 0
    self.restart_clock()
    return step, summary

  def restart_clock(self) -> None:
    """Starts the interval's clock now (the first call, once compiled)."""
    self._interval_start = time.perf_counter()
    self._excluded = 0.0

  def pause(self) -> None:
    """Stops the interval's clock until `resume`: time spent outside
    training calls (an evaluation, a save, compiling another program)
    while no call runs stays out of the throughput."""
    self._paused_at = time.perf_counter()

  def resume(self) -> None:
    self._excluded += time.perf_counter() - self._paused_at
