"""`algorithmic`: copy, reverse, sort and addition as translation tasks.

In the style of tensor2tensor's algorithmic problems. Ids: 0 is padding, 1
ends a sequence, symbols 0..9 are ids 2..11, and '+' (addition) is id 12.
Addition writes numbers least significant digit first. Input lengths are
uniform in [1, max_length] (at least 3 for addition) for `train` and
`validation`, and in (max_length, long_max_length] for `long`, the split that
measures length generalisation. Validation and long inputs never occur in
train.
"""

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from train.data import builder_config
from train.data.tokenizers import EOS_ID

TASKS = ('copy', 'reverse', 'sort', 'addition')
NUM_SYMBOLS = 10
SYMBOL_OFFSET = 2
PLUS_ID = SYMBOL_OFFSET + NUM_SYMBOLS
VOCAB_SIZE = PLUS_ID + 1


def _digits(number: int) -> np.ndarray:
  """Decimal digits of `number`, least significant first."""
  return np.array([int(d) for d in reversed(str(number))], np.int64)


def _value(digits: np.ndarray) -> int:
  return int(''.join(str(d) for d in reversed(digits)))


def generate(task: str, length: int, rng: np.random.Generator
             ) -> tuple[np.ndarray, np.ndarray]:
  """One (inputs, targets) pair of ids, each ending in EOS."""
  if task == 'addition':
    first_length = int(rng.integers(1, length - 1))
    first = rng.integers(0, NUM_SYMBOLS, first_length)
    second = rng.integers(0, NUM_SYMBOLS, length - 1 - first_length)
    inputs = np.concatenate([first + SYMBOL_OFFSET, [PLUS_ID],
                             second + SYMBOL_OFFSET])
    targets = _digits(_value(first) + _value(second)) + SYMBOL_OFFSET
  else:
    symbols = rng.integers(0, NUM_SYMBOLS, length)
    inputs = symbols + SYMBOL_OFFSET
    targets = {'copy': symbols, 'reverse': symbols[::-1],
               'sort': np.sort(symbols)}[task] + SYMBOL_OFFSET
  return (np.append(inputs, EOS_ID).astype(np.int32),
          np.append(targets, EOS_ID).astype(np.int32))


@dataclasses.dataclass
class AlgorithmicConfig(tfds.core.BuilderConfig):
  """Which task, how many examples, and how long."""

  task: str = 'reverse'
  num_train: int = 100_000
  num_eval: int = 1_000
  max_length: int = 40
  long_max_length: int = 400
  seed: int = 0

  def __post_init__(self):
    """Raises ValueError, naming the option, for values no build can
    satisfy (before anything is generated)."""
    if self.task not in TASKS:
      raise ValueError(f'task={self.task!r} must be one of {list(TASKS)}.')
    builder_config.check_integers(
        self, {'num_train': 1, 'num_eval': 1, 'seed': 0})
    shortest = _shortest(self.task)
    if self.max_length < shortest:
      raise ValueError(f'max_length={self.max_length} must be at least '
                       f'{shortest} for task {self.task!r}.')
    if self.long_max_length <= self.max_length:
      raise ValueError(f'long_max_length={self.long_max_length} must exceed '
                       f'max_length={self.max_length}.')
    short = _distinct_inputs(self.task, shortest, self.max_length)
    if self.num_train + self.num_eval > short:
      raise ValueError(
          f'num_train={self.num_train} + num_eval={self.num_eval} distinct '
          f'inputs are more than the {short} of lengths up to max_length='
          f'{self.max_length}.')
    long = _distinct_inputs(self.task, self.max_length + 1,
                            self.long_max_length)
    if self.num_eval > long:
      raise ValueError(f'num_eval={self.num_eval} distinct inputs are more '
                       f'than the {long} of the long split.')


def _shortest(task: str) -> int:
  """The shortest input (without EOS): two digits and '+' for addition."""
  return 3 if task == 'addition' else 1


def _distinct_inputs(task: str, shortest: int, longest: int) -> int:
  """How many different inputs have lengths in [shortest, longest]."""
  if task == 'addition':  # '+' after the first 1..length - 2 digits.
    return sum((length - 2) * NUM_SYMBOLS**(length - 1)
               for length in range(shortest, longest + 1))
  return sum(NUM_SYMBOLS**length for length in range(shortest, longest + 1))


class Algorithmic(tfds.core.GeneratorBasedBuilder):
  """Algorithmic sequence-to-sequence tasks, generated from a seed."""

  VERSION = tfds.core.Version('1.0.0')
  BUILDER_CONFIG_CLS = AlgorithmicConfig

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            'inputs': tfds.features.Tensor(shape=(None,), dtype=np.int32),
            'targets': tfds.features.Tensor(shape=(None,), dtype=np.int32),
        }))

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing is downloaded.
    config = self.builder_config
    min_length = _shortest(config.task)
    rng = np.random.default_rng(config.seed)
    train = self._draw(rng, config.num_train, min_length, config.max_length,
                       exclude=set())
    train_inputs = {inputs.tobytes() for inputs, _ in train}
    validation = self._draw(rng, config.num_eval, min_length,
                            config.max_length, exclude=train_inputs)
    long = self._draw(rng, config.num_eval, config.max_length + 1,
                      config.long_max_length, exclude=train_inputs)
    return {'train': self._generate_examples(train),
            'validation': self._generate_examples(validation),
            'long': self._generate_examples(long)}

  def _draw(self, rng, count, min_length, max_length, exclude):
    examples = []
    while len(examples) < count:
      length = int(rng.integers(min_length, max_length + 1))
      inputs, targets = generate(self.builder_config.task, length, rng)
      if inputs.tobytes() not in exclude:
        examples.append((inputs, targets))
    return examples

  def _generate_examples(self, examples):
    for index, (inputs, targets) in enumerate(examples):
      yield index, {'inputs': inputs, 'targets': targets}
