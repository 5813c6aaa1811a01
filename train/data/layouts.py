"""How canonical examples (see `train.data.datasets`) become rows of a
batch. The trainer picks a language model's layout from the config; a
dataset's task (train/data/tasks.py) makes its rows with these.

Row b of a batch of B rows is read from its own stream: example i of the
(shuffled) examples goes to row i mod B, and each row lays out its own
share alone (`RowBatches`; a language model's packed and padded rows are
computed together by train/data/packing.py, each row still its own). A
host thus prepares only the rows it places on its devices, and the
batches, and the data position a checkpoint keeps (row by row), do not
depend on how many hosts share them.

Language-model documents are laid out in one of three ways (LAYOUTS):
  packed:  cut into windows of at most L + 1 tokens (inputs tokens[:-1],
           targets tokens[1:], so every token after the first is a target
           exactly once), packed first-fit into rows of L with segment ids
           and positions within each document;
  padded:  the same windows, one a row, padded;
  streams: each row a stream of whole documents, one after another, cut
           into consecutive rows of L: row b of a batch continues row b of
           the batch before, as Transformer-XL's memory needs.
A packed row is first-fit packed among packing.PACKING_BINS rows of its
stream.
Shuffling is by document, or window by window for a corpus held in memory
(`Dataset.shuffle_windows`), so that a batch mixes many documents.
Sequence-to-sequence, classification and recall examples are one a row,
padded;
those longer than L are left out rather than truncated, which would change
their meaning.
"""

import collections
from collections.abc import Callable
import concurrent.futures
from typing import Any

import grain
import jax
import numpy as np

from train.base.errors import InputError

LAYOUTS = ('packed', 'padded', 'streams')


class WindowSource(grain.sources.RandomAccessDataSource):
  """The L + 1-token windows of in-memory documents, by index; `tokens(i)`
  is window i itself."""

  def __init__(self, documents: list[np.ndarray], seq_len: int):
    self._documents, self._length = documents, seq_len + 1
    # Window starts step by L: consecutive windows share one token, which
    # is the last target of one window and the first input of the next.
    starts = [(d, start) for d, document in enumerate(documents)
              for start in range(0, len(document) - 1, seq_len)]
    self._starts = np.array(starts, np.int64).reshape(-1, 2).tolist()

  def __len__(self) -> int:
    return len(self._starts)

  def tokens(self, index: int) -> np.ndarray:
    document, start = self._starts[index]
    return self._documents[document][start:start + self._length]

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {'tokens': self.tokens(index)}


def in_memory_windows(documents, seq_len: int) -> WindowSource:
  """The windows of LM examples {'tokens': document} held in memory, as the
  pipeline's own windowing would cut them, but shuffled one by one."""
  return WindowSource([documents[i]['tokens']
                       for i in range(len(documents))], seq_len)


class _ShareIterator(grain.DatasetIterator):
  """A row's share of the examples, read one at a time (those a filter
  left out, None, skipped). A row has no reader threads of its own
  (thousands on a host of many rows, each reading ahead): RowBatches'
  threads read the rows at once."""

  def __init__(self, examples: grain.MapDataset):
    super().__init__()
    self._examples, self._next = examples, 0

  def __next__(self):
    while self._next < len(self._examples):
      example = self._examples[self._next]
      self._next += 1
      if example is not None:
        return example
    raise StopIteration

  def get_state(self):
    return {'next_index': self._next}

  def set_state(self, state) -> None:
    self._next = state['next_index']


class _Share(grain.IterDataset):
  """See `_ShareIterator`."""

  def __init__(self, examples: grain.MapDataset):
    super().__init__()
    self._examples = examples

  def __iter__(self) -> _ShareIterator:
    return _ShareIterator(self._examples)


class _StreamIterator(grain.DatasetIterator):
  """Rows of `seq_len` (input, target) pairs reading the documents of its
  parent one after another. Its state is the parent's state before the
  first document not yet fully emitted and how many of that document's
  pairs were, so a restored iterator continues exactly."""

  def __init__(self, parent: grain.DatasetIterator, seq_len: int):
    super().__init__(parent)
    self._seq_len = seq_len
    # [(parent state before the document, inputs, targets)].
    self._documents = collections.deque()
    self._emitted = 0  # Pairs of the first document.
    self._exhausted = False

  def _fill(self) -> int:
    """Reads documents until a row's worth is buffered; returns how many
    pairs are available."""
    available = sum(len(d[1]) for d in self._documents) - self._emitted
    while available < self._seq_len and not self._exhausted:
      state = self._parent.get_state()
      try:
        tokens = next(self._parent)['tokens']
      except StopIteration:
        self._exhausted = True
        break
      self._documents.append((state, tokens[:-1], tokens[1:]))
      available += len(tokens) - 1
    return available

  def __next__(self) -> dict[str, np.ndarray]:
    count = min(self._fill(), self._seq_len)
    if not count:
      raise StopIteration
    inputs, targets, needed = [], [], count
    while needed:
      _, doc_inputs, doc_targets = self._documents[0]
      take = min(needed, len(doc_inputs) - self._emitted)
      inputs.append(doc_inputs[self._emitted:self._emitted + take])
      targets.append(doc_targets[self._emitted:self._emitted + take])
      needed -= take
      self._emitted += take
      if self._emitted == len(doc_inputs):
        self._documents.popleft()
        self._emitted = 0
    pieces = lambda x: _pad_to(np.concatenate(x).astype(np.int32),
                               self._seq_len)
    return {'inputs': pieces(inputs), 'targets': pieces(targets),
            'positions': np.arange(self._seq_len, dtype=np.int32),
            'weights': (np.arange(self._seq_len) < count).astype(np.float32)}

  def get_state(self):
    return {'parent': (self._documents[0][0] if self._documents
                       else self._parent.get_state()),
            'emitted': self._emitted}

  def set_state(self, state) -> None:
    self._parent.set_state(state['parent'])
    self._documents.clear()
    self._emitted = state['emitted']
    self._exhausted = False


class _Stream(grain.IterDataset):
  """A row's stream of whole documents; see `_StreamIterator`."""

  def __init__(self, documents: grain.IterDataset, seq_len: int):
    super().__init__(documents)
    self._seq_len = seq_len

  def __iter__(self) -> _StreamIterator:
    return _StreamIterator(iter(self._parent), self._seq_len)


def _next_or_none(stream: grain.DatasetIterator):
  return next(stream, None)


def _stacked(elements: list[dict | None]) -> dict[str, np.ndarray]:
  """The rows' elements stacked, zeros for a row that has none."""
  blank = {key: np.zeros_like(value) for key, value in
           next(e for e in elements if e is not None).items()}
  return {key: np.stack([(blank if e is None else e)[key]
                         for e in elements]) for key in blank}


class RowBatchesIterator(grain.DatasetIterator):
  """Batches made by `assemble` (of the rows' elements in order of the
  row, None for a row whose stream has ended) from the next element of
  each row's stream (`take(stream)`, None once it has ended), until every
  one has. Its state is each row's (`restore_rows`). With `threads`, the
  rows are read at once (each stream is its own, so the batches are the
  same)."""

  def __init__(self, rows: dict[int, Any], threads: int, *,
               take: Callable[[Any], Any] = _next_or_none,
               assemble: Callable[[list], dict] = _stacked):
    # grain's own iterators among the streams are its parents.
    super().__init__([stream for stream in rows.values()
                      if isinstance(stream, grain.DatasetIterator)])
    self._rows, self._take, self._assemble = rows, take, assemble
    self._ended = set()
    self._pool = (concurrent.futures.ThreadPoolExecutor(threads)
                  if threads else None)

  def __next__(self) -> dict[str, np.ndarray]:
    live = [row for row in self._rows if row not in self._ended]
    streams = [self._rows[row] for row in live]
    got = dict(zip(live, self._pool.map(self._take, streams) if self._pool
                   else map(self._take, streams)))
    self._ended.update(row for row, element in got.items() if element is None)
    if len(self._ended) == len(self._rows):
      raise StopIteration
    return self._assemble([got.get(row) for row in self._rows])

  def get_state(self):
    return {'rows': {str(row): stream.get_state()
                     for row, stream in self._rows.items()}}

  def set_state(self, state) -> None:
    restore_rows(state, self._rows)
    self._ended.clear()


def restore_rows(state: dict, rows: dict) -> None:
  """Sets each of `rows` ({row index: its stream}) to its position in a
  saved `state` of a batch's rows; InputError if the state lacks one. A
  position an older attnlab saved for the whole batch starts the streams
  again, saying so."""
  if 'rows' not in state:
    # An older attnlab read each batch whole (but for the streams
    # layout): its position has no counterpart in these streams.
    if jax.process_index() == 0:
      print('warning: the checkpoint\'s data position is that of an '
            'older attnlab\'s pipeline, which read each batch whole; the '
            'training data starts again from the beginning of its '
            'shuffled order.', flush=True)
    return
  saved = state['rows']
  if isinstance(saved, list):  # An older attnlab's streams, in order.
    saved = {str(row): row_state for row, row_state in enumerate(saved)}
  missing = [row for row in rows if str(row) not in saved]
  if missing:
    raise InputError(
        f'the data position saved with the checkpoint has no state for '
        f'row {missing[0]} of the batch: it holds {len(saved)} rows, '
        'saved with another config.batch_size.')
  for row, stream in rows.items():
    stream.set_state(saved[str(row)])


class RowBatches(grain.IterDataset):
  """Batches of the rows in `rows` ({row index: its stream of rows}), in
  order of the index, read by `threads` threads (0: in the calling one);
  see `RowBatchesIterator`."""

  def __init__(self, rows: dict[int, grain.IterDataset], threads: int = 0):
    super().__init__(list(rows.values()))
    self._row_streams = dict(sorted(rows.items()))
    self._threads = threads

  def __iter__(self) -> RowBatchesIterator:
    return RowBatchesIterator({row: iter(stream) for row, stream
                               in self._row_streams.items()}, self._threads)


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


def recall_row(example, seq_len: int) -> dict[str, np.ndarray]:
  """A recall example's row: scored where its target is given (not 0)."""
  targets = _pad_to(example['targets'], seq_len)
  return {'inputs': _pad_to(example['inputs'], seq_len),
          'targets': targets,
          'positions': np.arange(seq_len, dtype=np.int32),
          'weights': (targets > 0).astype(np.float32)}


def _fits(example, seq_len: int) -> bool:
  return all(len(example[key]) <= seq_len
             for key in ('inputs', 'targets') if key in example)


def lm_reader(documents: grain.MapDataset, seq_len: int, *,
              in_memory: bool) -> tuple[Callable[[int], np.ndarray | None],
                                        int]:
  """What gets shuffled, as (read, count): `read(i)` is the tokens of
  example i of `count`, or None for one left out. The windows one by one
  for documents held in memory, else the documents (but those of EOS
  alone, which have no target)."""
  if in_memory:
    windows = in_memory_windows(documents, seq_len)
    return windows.tokens, len(windows)
  kept = documents.filter(lambda doc: len(doc['tokens']) > 1)
  return (lambda index: None if (document := kept[index]) is None
          else document['tokens']), len(kept)


def streams(documents: grain.MapDataset, *, seq_len: int
            ) -> grain.IterDataset:
  """One row's stream of rows: its share of the documents, whole, one
  after another, cut into consecutive rows of `seq_len`."""
  return _Stream(_Share(documents), seq_len)


def example_rows(examples: grain.MapDataset, row, *, seq_len: int
                 ) -> grain.IterDataset:
  """One row's stream of rows: its share of the examples that fit in
  `seq_len`, each made a row by `row(example, seq_len)`."""
  rows = examples.filter(lambda example: _fits(example, seq_len)).map(
      lambda example: row(example, seq_len))
  return _Share(rows)
