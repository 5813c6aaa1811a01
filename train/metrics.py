"""Metrics: summaries of metric sums, and where they are written.

Every summary goes to `workdir/metrics.jsonl` (one JSON object a line,
flushed as written, so `tail -f` follows a run and a killed run keeps every
line), to TensorBoard event files under `workdir/tensorboard`, and to the
terminal.
"""

import json
import math
import os
import time

import jax
import numpy as np
import tensorboardX
import tqdm

LN2 = math.log(2.0)


def is_due(step: int, every: int, last_step: int) -> bool:
  """Whether a periodic action (log, eval, checkpoint) runs after `step`:
  every `every` steps (never if `every` <= 0) and after the last step."""
  return step == last_step or (every > 0 and step % every == 0)


def summarize_train(sums: dict[str, float]) -> dict[str, float]:
  weight = max(sums['weight_sum'], 1.0)
  return {'loss': sums['loss_sum'] / weight,
          'accuracy': sums['correct_sum'] / weight}


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


class MetricWriter:
  """Writes summaries from process 0; a no-op on the other hosts."""

  def __init__(self, workdir: str, total_steps: int, first_step: int):
    self._active = jax.process_index() == 0
    if not self._active:
      return
    self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a')
    self._tensorboard = tensorboardX.SummaryWriter(
        os.path.join(workdir, 'tensorboard'))
    self._progress = tqdm.tqdm(total=total_steps, initial=first_step,
                               unit='step', dynamic_ncols=True)

  def write(self, step: int, summary: dict[str, float]) -> None:
    if not self._active:
      return
    summary = {key: float(value) for key, value in summary.items()}
    self._jsonl.write(json.dumps({'step': step, **summary}) + '\n')
    self._jsonl.flush()
    for key, value in summary.items():
      self._tensorboard.add_scalar(key, value, step)
    self._tensorboard.flush()
    shown = ', '.join(f'{key} {value:.4g}' for key, value in summary.items())
    self._progress.write(f'step {step}: {shown}')

  def advance(self, steps: int = 1) -> None:
    if self._active:
      self._progress.update(steps)

  def close(self) -> None:
    if self._active:
      self._progress.close()
      self._jsonl.close()
      self._tensorboard.close()


class TrainLog:
  """Summarises training metrics every `log_every` steps, one step late.

  `add` is called right after a step is dispatched. The metrics of a logging
  interval are fetched only after the following step has been dispatched, so
  the host never waits for the device just to log.
  """

  def __init__(self, writer: MetricWriter, log_every: int, last_step: int):
    self._writer, self._log_every, self._last_step = (writer, log_every,
                                                      last_step)
    self._interval = []
    self._pending = None
    self._interval_start = time.perf_counter()

  def add(self, step: int, metrics: dict) -> None:
    self._write_pending()
    self._interval.append(metrics)
    self._writer.advance()
    if is_due(step, self._log_every, self._last_step):
      self._pending = (step, self._interval)
      self._interval = []

  def flush(self, step: int, extra: dict[str, float] | None = None) -> None:
    """Writes any pending summary now, merging `extra` (e.g. eval metrics,
    which `step` names) into it when it is for the same step."""
    extra = extra or {}
    if self._pending is not None and self._pending[0] == step:
      self._write_pending(extra)
    else:
      self._write_pending()
      if extra:
        self._writer.write(step, extra)

  def restart_clock(self) -> None:
    """Excludes time spent outside training steps (eval, saving) from the
    next throughput figure."""
    self._interval_start = time.perf_counter()

  def _write_pending(self, extra: dict[str, float] | None = None) -> None:
    if self._pending is None:
      return
    step, interval = self._pending
    self._pending = None
    interval = jax.device_get(interval)
    now = time.perf_counter()
    seconds = max(now - self._interval_start, 1e-9)
    self._interval_start = now
    sums = {key: float(np.sum([m[key] for m in interval]))
            for key in ('loss_sum', 'correct_sum', 'weight_sum',
                        'token_count')}
    summary = summarize_train(sums)
    summary['learning_rate'] = float(interval[-1]['learning_rate'])
    summary['grad_norm'] = float(interval[-1]['grad_norm'])
    summary['tokens_per_s'] = sums['token_count'] / seconds
    summary['steps_per_s'] = len(interval) / seconds
    self._writer.write(step, summary | (extra or {}))
