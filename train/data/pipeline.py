"""Batches of a dataset, with grain: endless shuffled training batches,
checkpointable, and evaluation batches in order.

Every batch is a dict of numpy arrays with a leading (global) batch dim, in
the layout of the dataset's task (train/data/tasks.py; rows: train/data/
layouts.py):
  lm:             inputs, targets, positions, weights               [b, L]
                  and segment_ids when rows are packed
  seq2seq:        inputs, decoder_inputs, targets, weights          [b, L]
  classification: inputs [b, L]; targets, weights                   [b]
`weights` is 1.0 where a target counts and 0.0 at padding. Every host
prepares the same global batches and the trainer places each host's rows on
its devices: the data stream does not depend on the number of hosts, so a
run resumes on another topology exactly where it stopped, at the price of
each host reading the whole batch.
"""

from collections.abc import Callable, Iterator

import grain
import jax
import jax.numpy as jnp
import numpy as np

from train.data.datasets import Dataset

# Batches prepared ahead of the training step, in a background thread.
PREFETCH_BATCHES = 2


def train_iterator(dataset: Dataset, *, seq_len: int, batch_size: int,
                   seed: int, layout: str = 'packed',
                   max_segments: int | None = None,
                   place: Callable[[dict], dict] | None = None,
                   prefetch: int = PREFETCH_BATCHES
                   ) -> grain.DatasetIterator:
  """Endless shuffled training batches; checkpointable with grain.

  `layout` (LM only) is one of layouts.LAYOUTS; a packed row holds at most
  `max_segments` windows (None: any number). `place`
  (a batch of numpy arrays -> the same on the devices) runs in the
  prefetching thread, `prefetch` batches ahead, so that batches wait on
  the devices before the call that needs them.
  """
  task = dataset.task
  examples = task.examples(dataset, 'train', seq_len=seq_len, layout=layout)
  batches = task.batches(dataset, examples.seed(seed).shuffle().repeat(),
                         seq_len=seq_len, batch_size=batch_size, seed=seed,
                         train=True, layout=layout, max_segments=max_segments)
  if place is not None:
    batches = batches.map(place)
  return iter(grain.experimental.ThreadPrefetchIterDataset(
      batches, prefetch_buffer_size=prefetch))


def poisoned(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """A copy of a batch on the devices whose first weight is NaN, so that
  the loss and the gradient of its step are not finite
  (config.debug_poison_step)."""
  weights = batch['weights']
  first = (0,) * weights.ndim
  return batch | {'weights': jax.jit(
      lambda w: w.at[first].set(jnp.nan),
      out_shardings=weights.sharding)(weights)}


def _pad_batch(batch: dict[str, np.ndarray], batch_size: int
               ) -> dict[str, np.ndarray]:
  """Fills a partial batch up to `batch_size` with zero-weight examples."""
  return {key: np.pad(value, [(0, batch_size - len(value))]
                      + [(0, 0)] * (value.ndim - 1))
          for key, value in batch.items()}


def eval_batches(dataset: Dataset, split: str, *, seq_len: int,
                 batch_size: int, num_batches: int, layout: str = 'packed',
                 max_segments: int | None = None
                 ) -> Iterator[dict[str, np.ndarray]]:
  """Batches of `split` in order, all of `batch_size` examples (packed
  rows of at most `max_segments` windows, as `train_iterator`'s).

  The whole split when `num_batches` is -1; otherwise exactly `num_batches`
  batches, the last ones empty (zero weight) if the split runs out first.
  """
  task = dataset.task
  batches = task.batches(
      dataset, task.examples(dataset, split, seq_len=seq_len, layout=layout),
      seq_len=seq_len, batch_size=batch_size, seed=0, train=False,
      layout=layout, max_segments=max_segments)
  count = 0
  empty = None
  for batch in batches:
    if count == num_batches:
      return
    batch = _pad_batch(batch, batch_size)
    empty = jax.tree.map(np.zeros_like, batch)
    count += 1
    yield batch
  while empty is not None and count < num_batches:
    count += 1
    yield empty
