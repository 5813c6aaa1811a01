"""The tasks a dataset can pose, as objects: the batches of each and how
they feed the model, what its loss and metrics count, what it reports and
what follows a run of it. The loop, the benchmarks and the tools ask a
dataset's task (`Dataset.task`, `datasets.task_of(name)`) instead of
testing its name.

  lm              next-token prediction over documents (bits per byte on
                  byte-level text); a run ends with a sample of text and
                  train.generate continues text
  seq2seq         a target sequence from a source, teacher-forced (exact
                  match); decoded by beam search with config.decode_splits
                  and train.translate
  classification  one class of a sequence
  mqar            the values of keys asked again (multi-query associative
                  recall), read causally and scored on the answers alone

Batches (see train/data/pipeline.py) are dicts of arrays [b, L]:
  lm:             inputs, targets, positions, weights, and segment_ids
                  when rows are packed
  seq2seq:        inputs, decoder_inputs, targets, weights
  classification: inputs [b, L]; targets, weights [b]
  mqar:           inputs, targets, positions, weights (1 on the answers)
"""

from collections.abc import Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np

from train.base.train_config import TrainConfig
from train.data import layouts, packing

Array = jax.Array
Batch = dict[str, Any]


class Task:
  """What every task answers; the subclasses below are the tasks."""

  name: str
  # The model's output is vocabulary logits, which the loss reads out a
  # block of tokens at a time; else class logits.
  vocabulary_logits = True
  # config.pack_sequences applies: several examples may share a row.
  packs = False
  # A run ends with a sample of text (config.sample_length).
  continues_text = False
  # Beam-search decoding evaluates it (config.decode_splits).
  decodes = False
  # The evaluation counts examples whose every target is right.
  exact_match = False
  # config.model.num_classes must equal the dataset's.
  has_classes = False
  # The evaluation figures the task is judged by, best first, each with
  # its better direction: a run's quality metric is the first it logs.
  quality: tuple[tuple[str, str], ...] = (('eval_accuracy', 'max'),
                                          ('eval_loss', 'min'))
  # The command that decodes a trained workdir with a key/value cache:
  # (what it does, its module), or None.
  decode_command: tuple[str, str] | None = None
  # Its examples are documents, each starting with EOS, under 'tokens';
  # else the model reads an example's 'inputs'.
  documents = False

  def quality_metric(self, summary: dict[str, float]) -> tuple[str, str]:
    """The quality metric of an evaluation's `summary` and its better
    direction ('min' or 'max')."""
    return next(((name, direction) for name, direction in self.quality
                 if name in summary), ('eval_loss', 'min'))

  @property
  def inputs_key(self) -> str:
    """The key of an example's tokens that the model reads first."""
    return 'tokens' if self.documents else 'inputs'

  def model_args(self, batch: Batch) -> tuple:
    """The model's positional arguments for a batch."""
    raise NotImplementedError

  def token_count(self, batch: Batch) -> Array:
    """Non-padding tokens the model reads, float32."""
    return jnp.sum(batch['inputs'] != 0).astype(jnp.float32)

  def synthetic_batch(self, config: TrainConfig,
                      seed: int = 0) -> dict[str, np.ndarray]:
    """A batch of random tokens of the shapes the pipeline gives for
    `config` (the config check's trace of the model, benchmarks and
    compiled-memory figures)."""
    raise NotImplementedError

  def examples(self, dataset, split: str, *, seq_len: int,
               layout: str) -> grain.MapDataset:
    """What gets shuffled: the examples of `split` (`dataset`: a
    train.data.datasets.Dataset)."""
    del seq_len, layout
    return dataset.splits[split]

  def batches(self, dataset, split: str, *, seq_len: int, batch_size: int,
              rows: Sequence[int], seed: int, train: bool, layout: str,
              max_segments: int | None) -> grain.IterDataset:
    """Batches of `rows` of `batch_size` of `split`: in training, endless
    and shuffled anew each epoch (from `seed`), else each example once, in
    order. Row r reads examples r, r + B, r + 2B, ... of that order (see
    train/data/layouts.py); packed rows (LM) hold at most `max_segments`
    windows."""
    examples = self.examples(dataset, split, seq_len=seq_len, layout=layout)
    if train:
      examples = examples.seed(seed).shuffle().repeat()
    return layouts.RowBatches({row: self.rows(
        dataset, examples[row::batch_size], seq_len=seq_len, seed=seed,
        train=train, layout=layout, max_segments=max_segments)
                               for row in rows},
                              threads=dataset.reader_threads)

  def rows(self, dataset, examples: grain.MapDataset, *, seq_len: int,
           seed: int, train: bool, layout: str,
           max_segments: int | None) -> grain.IterDataset:
    """One row's stream of rows from its share of the examples."""
    del dataset, seed, train, layout, max_segments
    return layouts.example_rows(examples, self._row, seq_len=seq_len)

  def _row(self, example, seq_len: int) -> dict[str, np.ndarray]:
    raise NotImplementedError


def _random_tokens(config: TrainConfig,
                   rng: np.random.Generator) -> np.ndarray:
  return rng.integers(1, config.model.vocab_size,
                      (config.batch_size, config.seq_len)).astype(np.int32)


def _positions(config: TrainConfig) -> np.ndarray:
  """int32 [batch, seq_len]: each row's positions 0 .. seq_len - 1."""
  return np.broadcast_to(np.arange(config.seq_len, dtype=np.int32),
                         (config.batch_size, config.seq_len)).copy()


class LanguageModelling(Task):
  name = 'lm'
  documents = True
  packs = True
  continues_text = True
  # Bits per byte where the tokenizer is byte-level.
  quality = (('eval_bits_per_byte', 'min'),) + Task.quality
  decode_command = ('sample', 'train.generate')

  def model_args(self, batch):
    return batch['inputs'], batch['positions'], batch.get('segment_ids')

  def token_count(self, batch):
    """The positions read: a tokenizer.json may give id 0 to a token."""
    return jnp.sum(batch['weights'] > 0).astype(jnp.float32)

  def synthetic_batch(self, config: TrainConfig, seed=0):
    rng = np.random.default_rng(seed)
    shape = (config.batch_size, config.seq_len)
    batch = {'inputs': _random_tokens(config, rng),
             'targets': _random_tokens(config, rng),
             'weights': np.ones(shape, np.float32),
             'positions': _positions(config)}
    if config.pack_sequences:
      batch['segment_ids'] = np.ones(shape, np.int32)
    return batch

  def examples(self, dataset, split, *, seq_len, layout):
    """The documents (streams; those of EOS alone, which have no target,
    left out)."""
    del seq_len, layout
    return dataset.splits[split].filter(lambda doc: len(doc['tokens']) > 1)

  def batches(self, dataset, split, *, seq_len, batch_size, rows, seed,
              train, layout, max_segments):
    """Streams as every task's rows; packed and padded rows computed
    together (train/data/packing.py), the windows of documents held in
    memory shuffled one by one."""
    if layout == 'streams':
      return super().batches(dataset, split, seq_len=seq_len,
                             batch_size=batch_size, rows=rows, seed=seed,
                             train=train, layout=layout,
                             max_segments=max_segments)
    read, count = layouts.lm_reader(dataset.splits[split], seq_len,
                                    in_memory=dataset.shuffle_windows)
    return packing.Batches(
        read, packing.Order(count, seed if train else None), rows=rows,
        batch_size=batch_size, seq_len=seq_len, packed=layout == 'packed',
        seed=seed, max_segments=max_segments,
        threads=dataset.reader_threads)

  def rows(self, dataset, examples, *, seq_len, seed, train, layout,
           max_segments):
    del dataset, seed, train, layout, max_segments
    return layouts.streams(examples, seq_len=seq_len)


class SequenceToSequence(Task):
  name = 'seq2seq'
  decodes = True
  exact_match = True
  quality = (('eval_exact_match', 'max'),) + Task.quality
  decode_command = ('decode', 'train.translate')

  def model_args(self, batch):
    return batch['inputs'], batch['decoder_inputs']

  def token_count(self, batch):
    """Inputs and targets."""
    return super().token_count(batch) + jnp.sum(batch['weights'] > 0)

  def synthetic_batch(self, config: TrainConfig, seed=0):
    rng = np.random.default_rng(seed)
    return {'inputs': _random_tokens(config, rng),
            'decoder_inputs': _random_tokens(config, rng),
            'targets': _random_tokens(config, rng),
            'weights': np.ones((config.batch_size, config.seq_len),
                               np.float32)}

  def _row(self, example, seq_len):
    return layouts.seq2seq_row(example, seq_len)


class Classification(Task):
  name = 'classification'
  vocabulary_logits = False
  has_classes = True

  def model_args(self, batch):
    return (batch['inputs'],)

  def synthetic_batch(self, config: TrainConfig, seed=0):
    rng = np.random.default_rng(seed)
    return {'inputs': _random_tokens(config, rng),
            'targets': rng.integers(0, config.model.num_classes,
                                    config.batch_size).astype(np.int32),
            'weights': np.ones(config.batch_size, np.float32)}

  def _row(self, example, seq_len):
    return layouts.classification_row(example, seq_len)


class AssociativeRecall(Task):
  """A causal model's next tokens, scored where a target is given (the
  answers); its quality is the accuracy of those answers."""

  name = 'mqar'

  def model_args(self, batch):
    return batch['inputs'], batch['positions'], None

  def synthetic_batch(self, config: TrainConfig, seed=0):
    rng = np.random.default_rng(seed)
    shape = (config.batch_size, config.seq_len)
    return {'inputs': _random_tokens(config, rng),
            'targets': _random_tokens(config, rng),
            'weights': (rng.random(shape) < 0.25).astype(np.float32),
            'positions': _positions(config)}

  def _row(self, example, seq_len):
    return layouts.recall_row(example, seq_len)


LM = LanguageModelling()
SEQ2SEQ = SequenceToSequence()
CLASSIFICATION = Classification()
MQAR = AssociativeRecall()
TASKS = {task.name: task for task in (LM, SEQ2SEQ, CLASSIFICATION, MQAR)}
