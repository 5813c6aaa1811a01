"""A language model's packed and padded batches, computed together.

Each row of a batch keeps its own stream, exactly as train/data/layouts.py
describes (row r reads examples r, r + B, r + 2B, ... of the shuffled
order, cuts its documents into windows of at most L + 1 tokens and packs
them first-fit among PACKING_BINS rows, or pads one a row), and its own
position. What changed is how the work is done: a row looks its next few
dozen examples up in the shuffled order at once, its packing is
arithmetic on window lengths, and the batch's arrays are filled by a few
numpy operations over every window of every row at once.

The order, the packing and the saved positions are grain's (a
`MapDataset.seed(seed).shuffle().repeat()` read `[r::B]`, its
`FlatMapIterDataset` of windows and `FirstFitPackIterDataset`), element
for element and state for state: tests/train/data/pipeline_batches.npz
holds batches and positions written by that grain pipeline, which
tests/train/data/test_pipeline_batches.py compares and resumes from.
"""

from collections.abc import Callable, Sequence
import functools

import grain
import numpy as np

from train.data import layouts

# Rows a row's packer fills at once (first-fit): more waste less of a row
# on padding, at the price of mixing documents from further apart. Every
# row packs a round on the same step: a pipeline read from files prefetches
# a round's batches; in memory, the loop's call ahead absorbs the burst.
PACKING_BINS = 8
# Examples of its share a row looks up in the shuffled order at once.
_LOOKED_UP = 64


class Order:
  """Which example of `length` the example at each position of the order
  is: grain's `MapDataset.seed(seed).shuffle().repeat()`, each epoch its
  own permutation, endless (training); or each example once, in order
  (`seed` None: evaluation)."""

  def __init__(self, length: int, seed: int | None):
    self.length = length
    self.endless = seed is not None
    # The seed grain's shuffle derives from `seed` (its epoch e permutes
    # with this + e), read from a shuffle grain makes alike.
    shuffled = None if seed is None else grain.MapDataset.range(1).seed(
        seed).shuffle()
    self._seed = None if shuffled is None else shuffled._seed  # pylint: disable=protected-access

  def indices(self, positions: range) -> list[int]:
    """The examples at `positions`."""
    if self._seed is None:
      return list(positions)
    shuffle, last = grain.experimental.index_shuffle, self.length - 1
    return [shuffle(index, last, (self._seed + epoch) % 2 ** 32, 4)
            for epoch, index in (divmod(position, self.length)
                                 for position in positions)]


@functools.lru_cache(maxsize=64)
def _bin_order(seed: int, bins: int) -> tuple[int, ...]:
  """The order a round of `bins` bins is given in (grain's draw); every
  row draws the same ones, a round at a time."""
  return tuple(np.random.default_rng(seed).permuted(range(bins)).tolist())


class _Row:
  """One row's stream of rows: its share of the documents, their windows,
  and (`packed`) its first-fit packer, in grain's steps and states.

  `read(index)`: the tokens of example `index`, or None for one left out.
  A packed row is a list of windows (each its inputs' tokens and one more),
  a padded row a list of one.
  """

  def __init__(self, row: int, rows: int, order: Order,
               read: Callable[[int], np.ndarray | None], *, seq_len: int,
               packed: bool, seed: int, shuffle_bins: bool,
               max_segments: int | None):
    self._first, self._step, self._order, self._read = row, rows, order, read
    self._share_length = (np.iinfo(np.int64).max
                          if order.endless and order.length
                          else len(range(row, order.length, rows)))
    self._seq_len, self._packed = seq_len, packed
    self._seed, self._shuffle_bins = seed, shuffle_bins
    self._max_segments = max_segments or np.iinfo(np.int64).max
    # The share: the next example to read, and the indices of those from
    # the `_looked_up_from`-th.
    self._next_example = 0
    self._looked_up, self._looked_up_from = [], 0
    # The windows of the last document read, the next to give, and the
    # share's position before that document.
    self._windows, self._next_window, self._document_at = [], 0, 0
    self._reset_packer()

  # --- The share and its windows (grain's FlatMapIterDataset). ---

  def _next_document(self) -> np.ndarray:
    while self._next_example < self._share_length:
      at = self._next_example - self._looked_up_from
      if not 0 <= at < len(self._looked_up):
        start = self._first + self._next_example * self._step
        self._looked_up = self._order.indices(
            range(start, start + _LOOKED_UP * self._step, self._step))
        self._looked_up_from, at = self._next_example, 0
      tokens = self._read(self._looked_up[at])
      self._next_example += 1
      if tokens is not None:
        return tokens
    raise StopIteration

  def _split(self, tokens: np.ndarray) -> list[np.ndarray]:
    """A document's windows of at most L inputs; consecutive windows share
    one token, the last target of one and the first input of the next."""
    if len(tokens) <= self._seq_len + 1:
      return [tokens] if len(tokens) > 1 else []
    return [tokens[start:start + self._seq_len + 1]
            for start in range(0, len(tokens) - 1, self._seq_len)]

  def _next_of_windows(self) -> np.ndarray:
    while self._next_window >= len(self._windows):
      self._document_at = self._next_example
      self._windows, self._next_window = self._split(self._next_document()), 0
    self._next_window += 1
    return self._windows[self._next_window - 1]

  def _position(self) -> tuple[int, int]:
    """Where the windows are: (the share's position before the document
    read last, the next of its windows)."""
    return self._document_at, self._next_window

  @staticmethod
  def _windows_state(position: tuple[int, int]) -> dict:
    """A position as grain's FlatMapIterDataset saves it."""
    return {'parent': {'next_index': position[0]},
            'next_index_in_buffer': position[1]}

  def _set_windows_state(self, state: dict) -> None:
    self._document_at = self._next_example = state['parent']['next_index']
    self._next_window = state['next_index_in_buffer']
    try:
      self._windows = self._split(self._next_document())
    except StopIteration:
      self._windows, self._next_window = [], 0

  # --- The packer (grain's FirstFitPackIterDataset). ---

  def _reset_packer(self) -> None:
    # The bins being packed ([windows] each) and their lengths.
    self._filling, self._fill = None, None
    self._round = None  # The packed bins being given, in their order.
    self._round_started = self._position()  # Before the round given.
    self._next_round_started = None
    self._next_bin, self._bins_given = 0, 0

  def get_state(self) -> dict:
    if not self._packed:
      return self._windows_state(self._position())
    return {'parent': self._windows_state(self._round_started),
            'next_row': self._next_bin, 'counter': self._bins_given}

  def set_state(self, state: dict) -> None:
    if not self._packed:
      self._set_windows_state(state)
      return
    self._set_windows_state(state['parent'])
    self._reset_packer()
    self._next_bin, self._bins_given = state['next_row'], state['counter']

  def take(self) -> list[np.ndarray] | None:
    """The next row's windows; None once the share has ended."""
    try:
      return self._next()
    except StopIteration:
      return None

  def _next(self) -> list[np.ndarray]:
    if not self._packed:
      return [self._next_of_windows()]
    if self._round is None:
      self._pack_a_round()
    row = self._round[self._next_bin]
    self._next_bin += 1
    self._bins_given += 1
    if self._next_bin == len(self._round):
      self._round, self._next_bin = None, 0
      self._round_started = self._next_round_started
    return row

  def _pack_a_round(self) -> None:
    """Packs windows first-fit until one fits no bin (it starts the next
    round) or the share ends; the round's bins are then given in an order
    drawn from the bins given so far."""
    while True:
      before = self._position()
      try:
        window = self._next_of_windows()
      except StopIteration:
        if not self._filling:
          raise
        self._close_round(None, before)
        return
      if self._filling is None:
        self._filling, self._fill = [], []
      length = len(window) - 1
      for index, bin_windows in enumerate(self._filling):
        if (self._fill[index] + length <= self._seq_len
            and len(bin_windows) < self._max_segments):
          bin_windows.append(window)
          self._fill[index] += length
          break
      else:
        if len(self._filling) < PACKING_BINS:
          self._filling.append([window])
          self._fill.append(length)
        else:
          self._close_round(window, before)
          return

  def _close_round(self, window: np.ndarray | None,
                   before: tuple[int, int]) -> None:
    bins = self._filling
    if self._shuffle_bins:
      bins = [bins[index] for index in _bin_order(
          self._seed + self._bins_given - self._next_bin, len(bins))]
    self._round, self._next_round_started = bins, before
    self._filling, self._fill = (None, None) if window is None else (
        [[window]], [len(window) - 1])


def assemble(rows: Sequence[list[np.ndarray] | None], seq_len: int, *,
             packed: bool) -> dict[str, np.ndarray]:
  """The batch of `rows` (each a list of windows, or None for a row whose
  share has ended: zeros), filled by numpy over every window at once.

  Packed: inputs, targets, positions (within each window), segment_ids
  (1, 2, ... in a row; 0 at padding) and weights. Padded (one window a
  row): inputs, targets, positions 0..L-1 and weights.
  """
  windows, starts, lengths, segments = [], [], [], []
  for index, row in enumerate(rows):
    at = index * seq_len  # Where the row's next window starts, flat.
    for number, window in enumerate(row or (), start=1):
      windows.append(window)
      starts.append(at)
      lengths.append(len(window) - 1)
      segments.append(number)
      at += len(window) - 1
  tokens = np.concatenate(windows)
  lengths = np.asarray(lengths)
  # Each input token: its place in its window, in `tokens` (a window has
  # one token more than its inputs) and in the batch, flat.
  first = np.cumsum(lengths) - lengths
  within = np.arange(first[-1] + lengths[-1]) - np.repeat(first, lengths)
  source = within + np.repeat(first + np.arange(len(windows)), lengths)
  place = within + np.repeat(starts, lengths)

  def filled(values: np.ndarray, dtype) -> np.ndarray:
    array = np.zeros((len(rows), seq_len), dtype)
    array.reshape(-1)[place] = values  # A view: the array is contiguous.
    return array

  inputs = filled(tokens[source], tokens.dtype)
  targets = filled(tokens[source + 1], tokens.dtype)
  segment_ids = filled(np.repeat(segments, lengths), np.int32)
  weights = (segment_ids > 0).astype(np.float32)
  if packed:
    return {'inputs': inputs, 'targets': targets,
            'positions': filled(within, np.int32),
            'segment_ids': segment_ids, 'weights': weights}
  live = np.array([row is not None for row in rows])
  positions = np.where(live[:, None], np.arange(seq_len, dtype=np.int32),
                       np.int32(0))
  return {'inputs': inputs, 'targets': targets, 'positions': positions,
          'weights': weights}


class Batches(grain.IterDataset):
  """Batches of `rows` (of a batch of `batch_size`) of a language model's
  examples, packed or padded (see the module's docstring): example i of
  the `order` is `read(i)`'s tokens (None: left out). Rows are read by
  `threads` threads (0: in the calling one)."""

  def __init__(self, read: Callable[[int], np.ndarray | None], order: Order,
               *, rows: Sequence[int], batch_size: int, seq_len: int,
               packed: bool, seed: int, max_segments: int | None,
               threads: int):
    super().__init__()
    self._read, self._order, self._rows = read, order, sorted(rows)
    self._batch_size, self._seq_len, self._packed = (batch_size, seq_len,
                                                     packed)
    self._seed, self._max_segments = seed, max_segments
    self._threads = threads

  def __iter__(self) -> layouts.RowBatchesIterator:
    return layouts.RowBatchesIterator(
        {row: _Row(row, self._batch_size, self._order, self._read,
                   seq_len=self._seq_len, packed=self._packed,
                   seed=self._seed, shuffle_bins=self._order.endless,
                   max_segments=self._max_segments) for row in self._rows},
        self._threads, take=_Row.take,
        assemble=functools.partial(assemble, seq_len=self._seq_len,
                                   packed=self._packed))
