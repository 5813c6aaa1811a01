"""Batches from canonical examples (see `train.data.datasets`), with grain.

Every batch is a dict of numpy arrays with a leading (global) batch dim:
  lm:             inputs, targets, positions, weights               [b, L]
                  and segment_ids when rows are packed
  seq2seq:        inputs, decoder_inputs, targets, weights          [b, L]
  classification: inputs [b, L]; targets, weights                   [b]
`weights` is 1.0 where a target counts and 0.0 at padding. Every host
prepares the same global batches and the trainer places each host's rows on
its devices: the data stream does not depend on the number of hosts, so a
run resumes on another topology exactly where it stopped, at the price of
each host reading the whole batch.

Language-model documents are laid out in one of three ways (LAYOUTS):
  packed:  cut into windows of at most L + 1 tokens (inputs tokens[:-1],
           targets tokens[1:], so every token after the first is a target
           exactly once), packed first-fit into rows of L with segment ids
           and positions within each document;
  padded:  the same windows, one a row, padded;
  streams: each row a stream of whole documents, one after another, cut
           into consecutive rows of L: row b of a batch continues row b of
           the batch before, as Transformer-XL's memory needs.
Shuffling is by document, or window by window for a corpus held in memory
(`Dataset.shuffle_windows`), so that a batch mixes many documents.
"""

import collections
from collections.abc import Callable, Iterator

import grain
import jax
import jax.numpy as jnp
import numpy as np

from train.data.datasets import Dataset

# Batches prepared ahead of the training step, in a background thread.
PREFETCH_BATCHES = 2


def _read_options(dataset: Dataset) -> grain.ReadOptions:
  """How examples are read: a corpus in memory in the batching thread
  itself (reader threads would only contend for the GIL: 8x slower for
  lm_stdlib's batches), files by a few reader threads."""
  if dataset.shuffle_windows:
    return grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
  return grain.ReadOptions(num_threads=4, prefetch_buffer_size=64)


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


def in_memory_windows(documents, seq_len: int) -> grain.MapDataset:
  """The windows of LM examples {'tokens': document} held in memory, as the
  pipeline's own windowing would cut them, but shuffled one by one."""
  tokens = [documents[i]['tokens'] for i in range(len(documents))]
  return grain.MapDataset.source(_WindowSource(tokens, seq_len))


class _StreamsIterator(grain.DatasetIterator):
  """Rows of `seq_len` (input, target) pairs, row b reading the documents of
  its own parent one after another. Its state is, per row, the parent's
  state before the first document not yet fully emitted and how many of
  that document's pairs were, so a restored iterator continues exactly."""

  def __init__(self, parents: list[grain.DatasetIterator], seq_len: int):
    super().__init__(parents)
    self._seq_len = seq_len
    # Per row: [(parent state before the document, inputs, targets)].
    self._documents = [collections.deque() for _ in parents]
    self._emitted = [0] * len(parents)  # Pairs of the first document.
    self._exhausted = [False] * len(parents)

  def _fill(self, row: int) -> int:
    """Reads documents until a row's worth is buffered; returns how many
    pairs are available."""
    documents = self._documents[row]
    available = sum(len(d[1]) for d in documents) - self._emitted[row]
    parent = self._parents[row]
    while available < self._seq_len and not self._exhausted[row]:
      state = parent.get_state()
      try:
        tokens = next(parent)['tokens']
      except StopIteration:
        self._exhausted[row] = True
        break
      documents.append((state, tokens[:-1], tokens[1:]))
      available += len(tokens) - 1
    return available

  def _row(self, row: int) -> dict[str, np.ndarray]:
    count = min(self._fill(row), self._seq_len)
    inputs, targets = [], []
    documents, needed = self._documents[row], count
    while needed:
      _, doc_inputs, doc_targets = documents[0]
      start = self._emitted[row]
      take = min(needed, len(doc_inputs) - start)
      inputs.append(doc_inputs[start:start + take])
      targets.append(doc_targets[start:start + take])
      needed -= take
      self._emitted[row] += take
      if self._emitted[row] == len(doc_inputs):
        documents.popleft()
        self._emitted[row] = 0
    pieces = lambda x: _pad_to(np.concatenate(x or [np.zeros(0, np.int32)])
                               .astype(np.int32), self._seq_len)
    return {'inputs': pieces(inputs), 'targets': pieces(targets),
            'positions': np.arange(self._seq_len, dtype=np.int32),
            'weights': (np.arange(self._seq_len) < count).astype(np.float32)}

  def __next__(self) -> dict[str, np.ndarray]:
    rows = [self._row(row) for row in range(len(self._parents))]
    if not any(row['weights'].any() for row in rows):
      raise StopIteration
    return {key: np.stack([row[key] for row in rows]) for key in rows[0]}

  def get_state(self):
    return {'rows': [
        {'parent': documents[0][0] if documents else parent.get_state(),
         'emitted': emitted}
        for documents, parent, emitted in zip(
            self._documents, self._parents, self._emitted)]}

  def set_state(self, state) -> None:
    for row, row_state in enumerate(state['rows']):
      self._parents[row].set_state(row_state['parent'])
      self._documents[row].clear()
      self._emitted[row] = row_state['emitted']
      self._exhausted[row] = False


class _Streams(grain.IterDataset):
  """Batches of `batch_size` document streams; see `_StreamsIterator`."""

  def __init__(self, documents: grain.MapDataset, seq_len: int,
               batch_size: int, read_options: grain.ReadOptions):
    self._rows = [documents[row::batch_size].to_iter_dataset(read_options)
                  for row in range(batch_size)]
    super().__init__(self._rows)
    self._seq_len = seq_len

  def __iter__(self) -> _StreamsIterator:
    return _StreamsIterator([iter(row) for row in self._rows], self._seq_len)


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


LAYOUTS = ('packed', 'padded', 'streams')


def _unpacked_lm_example(window, seq_len: int) -> dict[str, np.ndarray]:
  """One window in a row of its own, padded; no segment ids are needed."""
  length = len(window['inputs'])
  return {'inputs': _pad_to(window['inputs'], seq_len),
          'targets': _pad_to(window['targets'], seq_len),
          'positions': np.arange(seq_len, dtype=np.int32),
          'weights': (np.arange(seq_len) < length).astype(np.float32)}


def _examples(dataset: Dataset, split: str, seq_len: int,
              layout: str) -> grain.MapDataset:
  """What gets shuffled: LM windows one by one for a corpus in memory
  (except for streams, which need whole documents), else the examples."""
  if dataset.kind != 'lm':
    return dataset.splits[split]
  if dataset.shuffle_windows and layout != 'streams':
    return in_memory_windows(dataset.splits[split], seq_len)
  # A document of EOS alone has no target.
  return dataset.splits[split].filter(lambda doc: len(doc['tokens']) > 1)


def _batches(dataset: Dataset, examples: grain.MapDataset, *, seq_len: int,
             batch_size: int, seed: int, train: bool,
             layout: str) -> grain.IterDataset:
  """Per-kind shaping and batching; partial final batches when not `train`."""
  if dataset.kind == 'lm':
    if layout == 'streams':
      return _Streams(examples, seq_len, batch_size, _read_options(dataset))
    windows = grain.experimental.FlatMapIterDataset(
        examples.to_iter_dataset(_read_options(dataset)),
        _DocumentWindows(seq_len))
    if layout == 'padded':
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
  return examples.to_iter_dataset(_read_options(dataset)).batch(
      batch_size, drop_remainder=train)


def train_iterator(dataset: Dataset, *, seq_len: int, batch_size: int,
                   seed: int, layout: str = 'packed',
                   place: Callable[[dict], dict] | None = None
                   ) -> grain.DatasetIterator:
  """Endless shuffled training batches; checkpointable with grain.

  `layout` (LM only) is one of LAYOUTS, see the module docstring. `place`
  (a batch of numpy arrays -> the same on the devices) runs in the
  prefetching thread, so that batches wait on the devices before the step
  that needs them.
  """
  examples = _examples(dataset, 'train', seq_len, layout)
  batches = _batches(dataset, examples.seed(seed).shuffle().repeat(),
                     seq_len=seq_len, batch_size=batch_size, seed=seed,
                     train=True, layout=layout)
  if place is not None:
    batches = batches.map(place)
  return iter(grain.experimental.ThreadPrefetchIterDataset(
      batches, prefetch_buffer_size=PREFETCH_BATCHES))


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
                 batch_size: int, num_batches: int, layout: str = 'packed'
                 ) -> Iterator[dict[str, np.ndarray]]:
  """Batches of `split` in order, all of `batch_size` examples.

  The whole split when `num_batches` is -1; otherwise exactly `num_batches`
  batches, the last ones empty (zero weight) if the split runs out first.
  """
  batches = _batches(dataset,
                     _examples(dataset, split, seq_len, layout),
                     seq_len=seq_len, batch_size=batch_size, seed=0,
                     train=False, layout=layout)
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
