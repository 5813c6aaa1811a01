"""`listops`: nested list operations (Nangia & Bowman 2018), as in the Long
Range Arena (Tay et al. 2021).

Expressions like `[MAX 2 9 [MIN 4 7 ] 0 ]` with the operators MIN, MAX, MED
(the median, truncated to an integer) and SM (sum modulo 10) over digits;
the label is the value, one of ten classes. Trees are drawn as in the LRA
generator: below the maximum depth a node is an operator with probability
0.25 (else a digit), with 2..max_args arguments; expressions are kept when
their length in tokens lies strictly between min_length and max_length, and
no expression appears twice across the splits.

Ids: 0 is padding, digits 0..9 are ids 2..11, then the four operators and the
closing bracket.
"""

import dataclasses
import random

import numpy as np
import tensorflow_datasets as tfds

from train.data import builder_config

DIGIT_OFFSET = 2
OPERATORS = ('[MIN', '[MAX', '[MED', '[SM')
OPERATOR_IDS = {name: DIGIT_OFFSET + 10 + i for i, name in enumerate(OPERATORS)}
CLOSE_ID = DIGIT_OFFSET + 10 + len(OPERATORS)
VOCAB_SIZE = CLOSE_ID + 1
NUM_CLASSES = 10
OPERATOR_PROBABILITY = 0.25


def apply_operator(name: str, arguments: list[int]) -> int:
  if name == '[MIN':
    return min(arguments)
  if name == '[MAX':
    return max(arguments)
  if name == '[MED':
    return int(np.median(arguments))
  return sum(arguments) % 10


class _TooLong(Exception):
  pass


def generate_tree(rng: random.Random, max_depth: int, max_args: int,
                  max_tokens: int) -> tuple[list[int], int] | None:
  """(token ids, value) of a random expression, or None past `max_tokens`.

  Stopping a tree as soon as it is too long keeps exactly the distribution of
  the trees that are kept, at a fraction of the cost.
  """
  tokens = []

  def node(depth: int) -> int:
    if len(tokens) >= max_tokens:
      raise _TooLong
    if depth >= max_depth or rng.random() > OPERATOR_PROBABILITY:
      digit = rng.randrange(10)
      tokens.append(DIGIT_OFFSET + digit)
      return digit
    operator = OPERATORS[rng.randrange(len(OPERATORS))]
    tokens.append(OPERATOR_IDS[operator])
    values = [node(depth + 1) for _ in range(rng.randrange(2, max_args + 1))]
    tokens.append(CLOSE_ID)
    return apply_operator(operator, values)

  try:
    value = node(1)
  except _TooLong:
    return None
  return (tokens, value) if len(tokens) <= max_tokens else None


def tokens_to_text(ids) -> str:
  names = {i: name for name, i in OPERATOR_IDS.items()} | {CLOSE_ID: ']'}
  return ' '.join(names.get(int(i), str(int(i) - DIGIT_OFFSET))
                  for i in ids if int(i) != 0)


@dataclasses.dataclass
class ListOpsConfig(tfds.core.BuilderConfig):
  """Lengths (in tokens, exclusive bounds), split sizes and the seed."""

  min_length: int = 500
  max_length: int = 2000
  num_train: int = 96_000
  num_eval: int = 2_000
  max_depth: int = 10
  max_args: int = 10
  seed: int = 0

  def __post_init__(self):
    """Raises ValueError, naming the option, for values no build can
    satisfy (before anything is generated)."""
    builder_config.check_integers(self, {
        'min_length': 0, 'num_train': 1, 'num_eval': 1, 'max_depth': 1,
        'max_args': 2, 'seed': 0})
    if self.max_length < self.min_length + 2:
      raise ValueError(f'max_length={self.max_length} must exceed min_length='
                       f'{self.min_length} + 1: lengths lie strictly between.')


class ListOps(tfds.core.GeneratorBasedBuilder):
  """ListOps expressions and their values, generated from a seed."""

  VERSION = tfds.core.Version('1.0.0')
  BUILDER_CONFIG_CLS = ListOpsConfig

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            'inputs': tfds.features.Tensor(shape=(None,), dtype=np.int32),
            'label': tfds.features.ClassLabel(num_classes=NUM_CLASSES),
        }))

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing is downloaded.
    config = self.builder_config
    rng = random.Random(config.seed)
    counts = {'train': config.num_train, 'validation': config.num_eval,
              'test': config.num_eval}
    seen, splits = set(), {}
    for split, count in counts.items():
      examples = []
      while len(examples) < count:
        tree = generate_tree(rng, config.max_depth, config.max_args,
                             config.max_length - 1)
        if tree is None or len(tree[0]) <= config.min_length:
          continue
        key = bytes(tree[0])
        if key not in seen:
          seen.add(key)
          examples.append(tree)
      splits[split] = self._generate_examples(examples)
    return splits

  def _generate_examples(self, examples):
    for index, (tokens, value) in enumerate(examples):
      yield index, {'inputs': np.asarray(tokens, np.int32), 'label': value}
