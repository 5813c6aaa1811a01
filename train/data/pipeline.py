"""Batches from canonical examples (see `train.data.datasets`), with grain.

Every batch is a dict of numpy arrays with a leading per-host batch dim:
  lm:             inputs, targets, positions, segment_ids, weights  [b, L]
                  (no segment_ids when rows are not packed)
  seq2seq:        inputs, decoder_inputs, targets, weights          [b, L]
  classification: inputs [b, L]; targets, weights                   [b]
`weights` is 1.0 where a target counts and 0.0 at padding. Each host reads
its own slice of every split (`jax.process_index()` of
`jax.process_count()`); `batch_size` here is the per-host batch.

Language-model documents are cut into windows of at most L + 1 tokens
(inputs are tokens[:-1], targets tokens[1:], so every token after the first
is a target exactly once) and packed first-fit into rows of L, with segment
ids and positions within each document. Shuffling is by document; a corpus
of long documents that fits in memory is better given as `in_memory_windows`,
whose windows are shuffled one by one, so that a batch mixes many documents.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING

import grain
import jax
import numpy as np

if TYPE_CHECKING:  # datasets.py builds its splits with this module.
  from train.data.datasets import Dataset

# Batches prepared ahead of the training step, in a background thread.
PREFETCH_BATCHES = 2


class _DocumentWindows(grain.experimental.FlatMapTransform):
  """Splits an LM document into (inputs, targets) windows of <= L tokens."""

  def __init__(self, seq_len: int):
    self.seq_len = seq_len
    self.max_fan_out = np.iinfo(np.int32).max  # Documents have any length.

  def flat_map(self, example):
    tokens = example['tokens']
    last = len(tokens) - 1  # The last token is a target only.
    return [{'inputs': tokens[start:min(start + self.seq_len, last)],
             'targets': tokens[start + 1:min(start + self.seq_len, last) + 1]}
            for start in range(0, last, self.seq_len)]


class _WindowSource(grain.sources.RandomAccessDataSource):
  """The L + 1-token windows of in-memory documents, by index."""

  def __init__(self, documents: list[np.ndarray], seq_len: int):
    self._documents, self._length = documents, seq_len + 1
    # Window starts step by L: consecutive windows share one token, which
    # is the last target of one window and the first input of the next.
    starts = [(d, start) for d, document in enumerate(documents)
              for start in range(0, len(document) - 1, seq_len)]
    self._starts = np.array(starts, np.int64).reshape(-1, 2)

  def __len__(self) -> int:
    return len(self._starts)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    document, start = self._starts[index]
    return {'tokens': self._documents[document][start:start + self._length]}


def in_memory_windows(documents: list[np.ndarray], seq_len: int
                      ) -> grain.MapDataset:
  """LM examples of at most L + 1 tokens that cover `documents` exactly as
  the pipeline's own windowing would, but can be shuffled individually."""
  return grain.MapDataset.source(_WindowSource(documents, seq_len))


def _packed_lm_batch(batch) -> dict[str, np.ndarray]:
  segment_ids = batch['inputs_segment_ids']
  return {'inputs': batch['inputs'], 'targets': batch['targets'],
          'positions': batch['inputs_positions'], 'segment_ids': segment_ids,
          'weights': (segment_ids > 0).astype(np.float32)}


def _pad_to(x: np.ndarray, length: int) -> np.ndarray:
  return np.pad(x, (0, length - len(x)))


def _seq2seq_example(example, seq_len: int) -> dict[str, np.ndarray]:
  targets = _pad_to(example['targets'], seq_len)
  return {'inputs': _pad_to(example['inputs'], seq_len),
          # The decoder reads the targets shifted right, starting from 0.
          'decoder_inputs': np.concatenate([[0], targets[:-1]]).astype(
              np.int32),
          'targets': targets,
          'weights': (targets > 0).astype(np.float32)}


def _classification_example(example, seq_len: int) -> dict[str, np.ndarray]:
  return {'inputs': _pad_to(example['inputs'], seq_len),
          'targets': np.int32(example['label']),
          'weights': np.float32(1.0)}


def _fits(example, seq_len: int) -> bool:
  return all(len(example[key]) <= seq_len
             for key in ('inputs', 'targets') if key in example)


def _host_slice(split: grain.MapDataset) -> grain.MapDataset:
  return split[jax.process_index()::jax.process_count()]


def _unpacked_lm_example(window, seq_len: int) -> dict[str, np.ndarray]:
  """One window in a row of its own, padded; no segment ids are needed."""
  length = len(window['inputs'])
  return {'inputs': _pad_to(window['inputs'], seq_len),
          'targets': _pad_to(window['targets'], seq_len),
          'positions': np.arange(seq_len, dtype=np.int32),
          'weights': (np.arange(seq_len) < length).astype(np.float32)}


def _batches(dataset: 'Dataset', examples: grain.MapDataset, *, seq_len: int,
             batch_size: int, seed: int, train: bool,
             pack: bool) -> grain.IterDataset:
  """Per-kind shaping and batching; partial final batches when not `train`."""
  if dataset.kind == 'lm':
    windows = grain.experimental.FlatMapIterDataset(
        examples.to_iter_dataset(), _DocumentWindows(seq_len))
    if not pack:
      return windows.map(lambda w: _unpacked_lm_example(w, seq_len)).batch(
          batch_size, drop_remainder=train)
    packed = grain.experimental.FirstFitPackIterDataset(
        windows, length_struct={'inputs': seq_len, 'targets': seq_len},
        num_packing_bins=batch_size, seed=seed, shuffle_bins=train)
    return packed.batch(batch_size, drop_remainder=train).map(
        _packed_lm_batch)
  shape = (_seq2seq_example if dataset.kind == 'seq2seq'
           else _classification_example)
  # Longer examples are left out rather than truncated, which would change
  # their meaning.
  examples = examples.filter(lambda example: _fits(example, seq_len)).map(
      lambda example: shape(example, seq_len))
  return examples.to_iter_dataset().batch(batch_size, drop_remainder=train)


def train_iterator(dataset: 'Dataset', *, seq_len: int, batch_size: int,
                   seed: int, pack: bool = True) -> grain.DatasetIterator:
  """Endless shuffled training batches; checkpointable with grain.

  `pack` (LM only): several windows per row, told apart by segment ids;
  otherwise one window a row, padded.
  """
  examples = _host_slice(dataset.splits['train']).seed(seed).shuffle().repeat()
  batches = _batches(dataset, examples, seq_len=seq_len, batch_size=batch_size,
                     seed=seed, train=True, pack=pack)
  return iter(grain.experimental.ThreadPrefetchIterDataset(
      batches, prefetch_buffer_size=PREFETCH_BATCHES))


def _pad_batch(batch: dict[str, np.ndarray], batch_size: int
               ) -> dict[str, np.ndarray]:
  """Fills a partial batch up to `batch_size` with zero-weight examples."""
  return {key: np.pad(value, [(0, batch_size - len(value))]
                      + [(0, 0)] * (value.ndim - 1))
          for key, value in batch.items()}


def eval_batches(dataset: 'Dataset', split: str, *, seq_len: int,
                 batch_size: int, num_batches: int, pack: bool = True
                 ) -> Iterator[dict[str, np.ndarray]]:
  """Batches of `split` in order, all of `batch_size` examples.

  The whole split when `num_batches` is -1; otherwise exactly `num_batches`
  batches, the last ones empty (zero weight) if the split runs out first, so
  that every host runs the same number of evaluation steps.
  """
  batches = _batches(dataset, _host_slice(dataset.splits[split]),
                     seq_len=seq_len, batch_size=batch_size, seed=0,
                     train=False, pack=pack)
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
