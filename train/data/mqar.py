"""`mqar`: multi-query associative recall (Zoology, Arora et al. 2023).

An example of `length` tokens starts with `num_pairs` key-value pairs
(k1 v1 k2 v2 ...), distinct keys and distinct values; each key is then
asked once, later, among random tokens, and the token after it must be
the value it was paired with. Only those answers are scored. Query i sits
2 * gap_i tokens after the pairs, the gaps drawn without replacement with
probability proportional to gap^(power_a - 1) (a power law: most queries
come soon after the pairs, some far away).

Ids: keys are 1 .. V/2 - 1, values V/2 .. V - 1 (V: vocab_size); the
tokens between the queries are uniform in 1 .. V - 1 (a filler may repeat
a key: Zoology's generator's default), or with `random_fillers` False all
0 (the padding id, which nothing else draws: its figure 2's setting).
Examples are generated from (seed, split, index) when read, so a split of
any size costs no disk and no memory; `train` and `validation` draw from
different streams.
"""

import dataclasses

import numpy as np

from train.data import builder_config

SPLITS = ('train', 'validation')


@dataclasses.dataclass(frozen=True)
class MqarConfig:
  """Zoology's generator's settings (its names in brackets)."""

  # Token ids [vocab_size]: keys the lower half, values the upper.
  vocab_size: int = 8192
  # Key-value pairs, each asked once [num_kv_pairs].
  num_pairs: int = 8
  # Tokens of an example [input_seq_len].
  length: int = 64
  # Exponent of the query gaps' power law; 1 is uniform [power_a].
  power_a: float = 0.01
  # The tokens between queries random, else 0 [random_non_queries].
  random_fillers: bool = True
  num_train: int = 100_000
  num_eval: int = 3_000
  seed: int = 0

  def __post_init__(self):
    """Raises ValueError, naming the option, for settings no example can
    meet."""
    builder_config.check_integers(self, {
        'vocab_size': 1, 'num_pairs': 1, 'length': 1, 'num_train': 1,
        'num_eval': 1, 'seed': 0})
    if not isinstance(self.random_fillers, bool):
      raise ValueError(f'random_fillers={self.random_fillers!r} must be True '
                       'or False.')
    if not 0 < self.power_a <= 1:
      raise ValueError(f'power_a={self.power_a!r} must be in (0, 1].')
    if self.length % 2 or self.length < 4 * self.num_pairs:
      raise ValueError(
          f'length={self.length} must be even and at least 4 * num_pairs = '
          f'{4 * self.num_pairs} (the pairs, then a query and its answer '
          'slot for each).')
    if self.vocab_size // 2 - 1 < self.num_pairs:
      raise ValueError(
          f'vocab_size={self.vocab_size} has {self.vocab_size // 2 - 1} key '
          f'ids, fewer than num_pairs={self.num_pairs} distinct keys.')

  def size(self, split: str) -> int:
    return self.num_train if split == 'train' else self.num_eval


def gap_probabilities(space: int, power_a: float) -> np.ndarray:
  """float64 [space]: the probability of each query gap 0 .. space - 1."""
  weights = power_a * np.arange(1, space + 1, dtype=np.float64) ** (
      power_a - 1)
  return weights / weights.sum()


def example(config: MqarConfig, split: str, index: int
            ) -> dict[str, np.ndarray]:
  """Example `index` of `split`: 'inputs' int32 [length], and 'targets'
  int32 [length], the value at each query key's position and 0 (not
  scored) elsewhere."""
  rng = np.random.default_rng((config.seed, SPLITS.index(split), index))
  pairs, half = config.num_pairs, config.vocab_size // 2
  keys = 1 + rng.choice(half - 1, pairs, replace=False)
  values = half + rng.choice(config.vocab_size - half, pairs, replace=False)
  context = 2 * pairs
  space = (config.length - context) // 2
  gaps = rng.choice(space, pairs, replace=False,
                    p=gap_probabilities(space, config.power_a))
  inputs = (rng.integers(1, config.vocab_size, config.length)
            if config.random_fillers else np.zeros(config.length, np.int64))
  inputs[0:context:2], inputs[1:context:2] = keys, values
  queries = context + 2 * gaps
  inputs[queries] = keys
  targets = np.zeros(config.length, np.int64)
  targets[queries] = values
  return {'inputs': inputs.astype(np.int32),
          'targets': targets.astype(np.int32)}


class Examples:
  """The examples of one split, made when read (a grain data source)."""

  def __init__(self, config: MqarConfig, split: str):
    self._config, self._split = config, split

  def __len__(self) -> int:
    return self._config.size(self._split)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < len(self):
      raise IndexError(index)
    return example(self._config, self._split, int(index))
