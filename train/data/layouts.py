"""How canonical examples (see `train.data.datasets`) become rows of a
batch. The trainer picks a language model's layout from the config; a
dataset's task (train/data/tasks.py) batches its examples with these.

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
Sequence-to-sequence and classification examples are one a row, padded;
those longer than L are left out rather than truncated, which would change
their meaning.
"""

import collections
import functools

import grain
import numpy as np

from train.base.errors import InputError

LAYOUTS = ('packed', 'padded', 'streams')

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


def check_segments(segment_ids_BxT: np.ndarray,
                   max_segments: int | None) -> None:
  """InputError naming the key if a packed row holds more windows (runs of
  one nonzero id) than `max_segments`, which attention may rely on."""
  if max_segments is None:
    return
  starts = np.concatenate(
      [np.ones_like(segment_ids_BxT[:, :1], bool),
       segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)
  most = int(np.max(np.sum(starts & (segment_ids_BxT > 0), axis=1)))
  if most > max_segments:
    raise InputError(
        f'a packed row holds {most} windows, more than '
        f'config.model.max_segments_per_row={max_segments}.')


def _packed_lm_batch(batch, max_segments: int | None
                     ) -> dict[str, np.ndarray]:
  segment_ids = batch['inputs_segment_ids']
  check_segments(segment_ids, max_segments)
  return {'inputs': batch['inputs'], 'targets': batch['targets'],
          'positions': batch['inputs_positions'], 'segment_ids': segment_ids,
          'weights': (segment_ids > 0).astype(np.float32)}


def _pad_to(x: np.ndarray, length: int) -> np.ndarray:
  return np.pad(x, (0, length - len(x)))


def seq2seq_row(example, seq_len: int) -> dict[str, np.ndarray]:
  targets = _pad_to(example['targets'], seq_len)
  return {'inputs': _pad_to(example['inputs'], seq_len),
          # The decoder reads the targets shifted right, starting from 0.
          'decoder_inputs': np.concatenate([[0], targets[:-1]]).astype(
              np.int32),
          'targets': targets,
          'weights': (targets > 0).astype(np.float32)}


def classification_row(example, seq_len: int) -> dict[str, np.ndarray]:
  return {'inputs': _pad_to(example['inputs'], seq_len),
          'targets': np.int32(example['label']),
          'weights': np.float32(1.0)}


def _fits(example, seq_len: int) -> bool:
  return all(len(example[key]) <= seq_len
             for key in ('inputs', 'targets') if key in example)


def _unpacked_lm_example(window, seq_len: int) -> dict[str, np.ndarray]:
  """One window in a row of its own, padded; no segment ids are needed."""
  length = len(window['inputs'])
  return {'inputs': _pad_to(window['inputs'], seq_len),
          'targets': _pad_to(window['targets'], seq_len),
          'positions': np.arange(seq_len, dtype=np.int32),
          'weights': (np.arange(seq_len) < length).astype(np.float32)}


def lm_examples(documents: grain.MapDataset, seq_len: int, *, layout: str,
                in_memory: bool) -> grain.MapDataset:
  """What gets shuffled: the windows one by one for documents held in
  memory (except for streams, which need whole documents), else the
  documents."""
  if in_memory and layout != 'streams':
    return in_memory_windows(documents, seq_len)
  # A document of EOS alone has no target.
  return documents.filter(lambda doc: len(doc['tokens']) > 1)


def lm_batches(examples: grain.MapDataset, *, seq_len: int, batch_size: int,
               seed: int, train: bool, layout: str,
               read_options: grain.ReadOptions,
               max_segments: int | None = None) -> grain.IterDataset:
  """Batches of LM examples in `layout`; partial final batches when not
  `train`; a packed row closes at `max_segments` windows (None: never)."""
  if layout == 'streams':
    return _Streams(examples, seq_len, batch_size, read_options)
  windows = grain.experimental.FlatMapIterDataset(
      examples.to_iter_dataset(read_options), _DocumentWindows(seq_len))
  if layout == 'padded':
    return windows.map(lambda w: _unpacked_lm_example(w, seq_len)).batch(
        batch_size, drop_remainder=train)
  packed = grain.experimental.FirstFitPackIterDataset(
      windows, length_struct={'inputs': seq_len, 'targets': seq_len},
      num_packing_bins=batch_size, seed=seed, shuffle_bins=train,
      max_sequences_per_bin=max_segments)
  return packed.batch(batch_size, drop_remainder=train).map(
      functools.partial(_packed_lm_batch, max_segments=max_segments))


def example_batches(examples: grain.MapDataset, row, *, seq_len: int,
                    batch_size: int, train: bool,
                    read_options: grain.ReadOptions) -> grain.IterDataset:
  """Batches of the examples that fit in `seq_len`, each made a row by
  `row(example, seq_len)`; partial final batches when not `train`."""
  rows = examples.filter(lambda example: _fits(example, seq_len)).map(
      lambda example: row(example, seq_len))
  return rows.to_iter_dataset(read_options).batch(
      batch_size, drop_remainder=train)
