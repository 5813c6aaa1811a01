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

from collections.abc import Callable, Iterator, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np

from train.data import layouts
from train.data.datasets import Dataset

# Batches prepared ahead of the training step, in a background thread: a
# packing round (every row packs its next layouts.PACKING_BINS rows on the
# same step, a burst the steps between must not wait for).
PREFETCH_BATCHES = layouts.PACKING_BINS + 1


def _row_batches(dataset: Dataset, examples, *, seq_len: int,
                 batch_size: int, rows: Sequence[int], seed: int,
                 train: bool, layout: str, max_segments: int | None
                 ) -> layouts.RowBatches:
  """Batches of `rows` of `batch_size`, row r reading examples r, r + B,
  r + 2B, ... of `examples`."""
  return layouts.RowBatches({row: dataset.task.rows(
      dataset, examples[row::batch_size], seq_len=seq_len, seed=seed,
      train=train, layout=layout, max_segments=max_segments)
      for row in rows}, threads=dataset.reader_threads)


def train_iterator(dataset: Dataset, *, seq_len: int, batch_size: int,
                   seed: int, layout: str = 'packed',
                   max_segments: int | None = None,
                   rows: Sequence[int] | None = None,
                   place: Callable[[dict], dict] | None = None,
                   prefetch: int = PREFETCH_BATCHES
                   ) -> grain.DatasetIterator:
  """Endless shuffled training batches; checkpointable with grain.

  `layout` (LM only) is one of layouts.LAYOUTS; a packed row holds at most
  `max_segments` windows (None: any number). `rows`: the rows of each
  batch of `batch_size` that this iterator prepares, in order (None: all);
  its state is theirs. `place` (a batch of numpy arrays -> the same on the
  devices) runs in the prefetching thread, `prefetch` batches ahead, so
  that batches wait on the devices before the call that needs them.
  """
  task = dataset.task
  examples = task.examples(dataset, 'train', seq_len=seq_len, layout=layout)
  batches = _row_batches(
      dataset, examples.seed(seed).shuffle().repeat(), seq_len=seq_len,
      batch_size=batch_size, seed=seed, train=True, layout=layout,
      max_segments=max_segments,
      rows=range(batch_size) if rows is None else rows)
  if place is not None:
    batches = batches.map(place)
  return iter(grain.experimental.ThreadPrefetchIterDataset(
      batches, prefetch_buffer_size=prefetch))


def merged_rows(states: list[dict]) -> dict:
  """One state of every row from the states of iterators of some rows each
  (train_iterator's `rows`; a host's each): what a checkpoint of several
  hosts keeps, from which any iterator restores its rows."""
  return {'rows': {row: row_state for state in states
                   for row, row_state in state['rows'].items()}}


def poisoned(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """A copy of a batch on the devices whose first weight is NaN, so that
  the loss and the gradient of its step are not finite
  (config.debug_poison_step)."""
  weights = batch['weights']
  first = (0,) * weights.ndim
  return batch | {'weights': jax.jit(
      lambda w: w.at[first].set(jnp.nan),
      out_shardings=weights.sharding)(weights)}


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
  batches = _row_batches(
      dataset, dataset.task.examples(dataset, split, seq_len=seq_len,
                                     layout=layout),
      seq_len=seq_len, batch_size=batch_size, rows=range(batch_size),
      seed=0, train=False, layout=layout, max_segments=max_segments)
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
