"""Batches of a dataset, with grain: endless shuffled training batches,
checkpointable, and evaluation batches in order.

Every batch is a dict of numpy arrays with a leading (global) batch dim, in
the layout of the dataset's task (train/data/tasks.py; rows: train/data/
layouts.py):
  lm:             inputs, targets, positions, weights               [b, L]
                  and segment_ids when rows are packed
  seq2seq:        inputs, decoder_inputs, targets, weights          [b, L]
  classification: inputs [b, L]; targets, weights                   [b]
`weights` is 1.0 where a target counts and 0.0 at padding. Each row reads
its own share of the examples (train/data/layouts.py), so a host prepares
only the rows it places on its devices in training, and the rows do not
depend on the number of hosts: a run resumes on another topology exactly
where it stopped, its iterator's state being row by row. Evaluation
batches are read whole on every host.
"""

from collections.abc import Iterator, Sequence
import queue
import threading

import grain
import jax
import numpy as np

from train.data import packing
from train.data.datasets import Dataset

# Batches a pipeline that reads files prepares ahead, in a thread of its
# own: a packing round (every row packs its next packing.PACKING_BINS rows
# on the same step, a burst the steps between must not wait for).
PREFETCH_BATCHES = packing.PACKING_BINS + 1


def _produce(source: grain.DatasetIterator, buffer: queue.Queue,
             stop: threading.Event) -> None:
  """Puts (element, the source's state after it, None) in `buffer` until
  `stop`; an error (StopIteration too) as (None, None, error), last."""
  while not stop.is_set():
    try:
      item = (next(source), source.get_state(), None)
    except BaseException as error:  # pylint: disable=broad-except
      item = (None, None, error)
    while not stop.is_set():
      try:
        buffer.put(item, timeout=0.1)
        break
      except queue.Full:
        continue
    if item[2] is not None:
      return


class Prefetch(grain.DatasetIterator):
  """The elements of `parent`, `size` ahead (0: none, made when asked for)
  by a thread of their own; its state is the parent's after the element
  last given. Unlike grain's ThreadPrefetchIterDataset, it does not
  deep-copy the parent's states (the batches' streams make each afresh):
  copying one cost more than making the batch."""

  def __init__(self, parent: grain.DatasetIterator, size: int):
    super().__init__()
    self._source, self._size = parent, size
    self._state = parent.get_state()
    self._thread, self._buffer, self._stop = None, None, None

  def __next__(self):
    if not self._size:
      batch = next(self._source)
      self._state = self._source.get_state()
      return batch
    if self._thread is None:
      self._buffer, self._stop = queue.Queue(self._size), threading.Event()
      # The thread holds the source, not this iterator, which a caller may
      # drop without closing it (grain's __del__ closes it then).
      self._thread = threading.Thread(
          target=_produce, args=(self._source, self._buffer, self._stop),
          daemon=True, name='attnlab-prefetch')
      self._thread.start()
    batch, state, error = self._buffer.get()
    if error is not None:
      self._halt()
      raise error
    self._state = state
    return batch

  def _halt(self) -> None:
    """Stops the thread, dropping what it made ahead."""
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None

  def get_state(self) -> dict:
    return self._state

  def set_state(self, state: dict) -> None:
    self._halt()
    self._source.set_state(state)
    self._state = self._source.get_state()

  def close(self) -> None:
    self._halt()


def train_iterator(dataset: Dataset, *, seq_len: int, batch_size: int,
                   seed: int, layout: str = 'packed',
                   max_segments: int | None = None,
                   rows: Sequence[int] | None = None,
                   prefetch: int = PREFETCH_BATCHES
                   ) -> Prefetch:
  """Endless shuffled training batches; checkpointable with grain.

  `layout` (LM only) is one of layouts.LAYOUTS; a packed row holds at most
  `max_segments` windows (None: any number). `rows`: the rows of each
  batch of `batch_size` that this iterator prepares, in order (None: all);
  its state is theirs. A thread makes them `prefetch` batches ahead (0:
  none).
  """
  batches = dataset.task.batches(
      dataset, 'train', seq_len=seq_len, batch_size=batch_size,
      rows=range(batch_size) if rows is None else rows, seed=seed,
      train=True, layout=layout, max_segments=max_segments)
  return Prefetch(iter(batches), prefetch)


def merged_rows(states: list[dict]) -> dict:
  """One state of every row from the states of iterators of some rows each
  (train_iterator's `rows`; a host's each): what a checkpoint of several
  hosts keeps, from which any iterator restores its rows."""
  return {'rows': {row: row_state for state in states
                   for row, row_state in state['rows'].items()}}


def poisoned(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A copy of a batch (of numpy arrays) whose first weight is NaN, so that
  the loss and the gradient of its step are not finite
  (config.debug_poison_step)."""
  weights = batch['weights'].copy()
  weights.flat[0] = np.nan
  return batch | {'weights': weights}


def eval_batches(dataset: Dataset, split: str, *, seq_len: int,
                 batch_size: int, num_batches: int, layout: str = 'packed',
                 max_segments: int | None = None
                 ) -> Iterator[dict[str, np.ndarray]]:
  """Batches of `split` in order, all of `batch_size` rows, laid out as
  `train_iterator`'s (packed rows of at most `max_segments` windows); a
  row whose share of the split has ended is empty (zero weight).

  The whole split when `num_batches` is -1; otherwise exactly `num_batches`
  batches, the last ones empty if the split runs out first.
  """
  batches = dataset.task.batches(
      dataset, split, seq_len=seq_len, batch_size=batch_size,
      rows=range(batch_size), seed=0, train=False, layout=layout,
      max_segments=max_segments)
  count = 0
  empty = None
  for batch in batches:
    if count == num_batches:
      return
    empty = jax.tree.map(np.zeros_like, batch)
    count += 1
    yield batch
  while empty is not None and count < num_batches:
    count += 1
    yield empty
