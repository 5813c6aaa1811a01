"""A sweep's search space: what a config's `get_sweep()` may return instead
of a grid (configs/grid.py), for `python -m experiments.sweep`.

  def get_sweep():
    return search.Space(
        {'learning_rate': search.log_uniform(1e-4, 3e-3),
         'model.num_layers': search.int_range(1, 4),
         'model.position': search.choice(['learned', 'rope'])},
        trials=20, metric='eval_accuracy', mode='max')

Keys are config keys, dotted for nested ones, or the name of a choice of
presets, each setting several keys at once (a model's shape with the steps
it runs in a fixed time):

  'shape': search.presets({'narrow': {'model.d_model': 128,
                                      'num_train_steps': 600},
                           'wide': {'model.d_model': 256,
                                    'num_train_steps': 250}})

The trials are drawn by a sampler ('tpe', Optuna's tree-structured Parzen
estimator, or 'random') and a pruner stops those whose metric, reported at
every evaluation at its fraction of the trial's own num_train_steps, is
worse than the median of the finished trials at the same fraction
('median'; a fraction no other trial evaluated at is judged by none), or
outside the best third at a rung of asynchronous successive halving
('asha', rungs at prune_after's fraction times 1, 3, 9, ..., each taking
a trial's first report at or past it), or none ('none'). Presets whose
eval_every is the same share of their num_train_steps are compared like
with like. Nothing here needs Optuna: the
sweep turns these into its distributions (experiments/study.py).
"""

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Uniform:
  """A float in [low, high]; `log`: uniform in log(value)."""
  low: float
  high: float
  log: bool = False

  def __post_init__(self):
    if not self.low < self.high:
      raise ValueError(f'needs low < high, got {self.low} and {self.high}.')
    if self.log and self.low <= 0:
      raise ValueError(f'a log scale needs low > 0, got {self.low}.')

  @property
  def bounds(self) -> list[float]:
    return [self.low, self.high]


@dataclasses.dataclass(frozen=True)
class IntRange:
  """An integer in [low, high] (both included), every `step`th from low;
  `log`: uniform in log(value)."""
  low: int
  high: int
  step: int = 1
  log: bool = False

  def __post_init__(self):
    if not all(isinstance(v, int) for v in (self.low, self.high, self.step)):
      raise ValueError('int_range takes integers.')
    if not self.low < self.high or self.step < 1:
      raise ValueError(f'needs low < high and step >= 1, got {self.low}, '
                       f'{self.high}, {self.step}.')
    if self.log and (self.low <= 0 or self.step != 1):
      raise ValueError('a log scale needs low > 0 and step 1.')

  @property
  def bounds(self) -> list[int]:
    return [self.low, self.low + (self.high - self.low)
            // self.step * self.step]


@dataclasses.dataclass(frozen=True)
class Choice:
  """One of `values` (numbers, strings, booleans or None). With `sets`
  (presets()), each value is a name and sets[i] the ((key, value), ...)
  that values[i] stands for."""
  values: tuple[Any, ...]
  sets: tuple[tuple[tuple[str, Any], ...], ...] = ()

  def __post_init__(self):
    if len(self.values) < 2 or len(set(self.values)) != len(self.values):
      raise ValueError(f'choice needs two or more distinct values, got '
                       f'{list(self.values)}.')
    if self.sets and not all(self.sets):
      raise ValueError('each preset sets one or more keys.')

  def overrides(self, value: Any) -> dict[str, Any]:
    """The config keys `value` sets: those of its preset."""
    return dict(self.sets[self.values.index(value)])

  @property
  def bounds(self) -> list[Any]:
    return list(self.values)


def uniform(low: float, high: float) -> Uniform:
  return Uniform(float(low), float(high))


def log_uniform(low: float, high: float) -> Uniform:
  return Uniform(float(low), float(high), log=True)


def int_range(low: int, high: int, step: int = 1,
              log: bool = False) -> IntRange:
  return IntRange(low, high, step, log)


def choice(values) -> Choice:
  return Choice(tuple(values))


def presets(named: dict[str, dict[str, Any]]) -> Choice:
  """A choice of names, each standing for the config keys it sets."""
  return Choice(tuple(named), tuple(tuple(sorted(keys.items()))
                                    for keys in named.values()))


Distribution = Uniform | IntRange | Choice
SAMPLERS = ('tpe', 'random')
PRUNERS = ('median', 'asha', 'none')


@dataclasses.dataclass(frozen=True)
class Space:
  """A search: `trials` drawn from `space` by `sampler`, ranked by
  `metric` (a key of the final evaluation; None: the task's quality
  metric) with `mode` 'min' or 'max' (None: known for the metric).

  The pruner judges a trial only from `prune_after` (a fraction of its
  num_train_steps, below 1: the final evaluation is not reported) on, and
  only once `startup_trials` trials have finished; the sampler draws
  at random for the first `startup_trials` trials (TPE).
  `seed`: with the trial's number, seeds its draw.
  """
  space: dict[str, Distribution]
  trials: int
  metric: str | None = None
  mode: str | None = None
  sampler: str = 'tpe'
  pruner: str = 'median'
  prune_after: float = 0.5
  startup_trials: int = 3
  seed: int = 0

  def __post_init__(self):
    if not self.space:
      raise ValueError('the search space is empty.')
    for key, distribution in self.space.items():
      if not isinstance(distribution, Distribution):
        raise ValueError(f'{key}: {distribution!r} is not a distribution '
                         '(uniform, log_uniform, int_range or choice).')
    if self.trials < 1:
      raise ValueError(f'trials={self.trials}: needs one or more.')
    if self.mode not in (None, 'min', 'max'):
      raise ValueError(f"mode={self.mode!r}: 'min' or 'max'.")
    if self.sampler not in SAMPLERS:
      raise ValueError(f'sampler={self.sampler!r}: one of {SAMPLERS}.')
    if self.pruner not in PRUNERS:
      raise ValueError(f'pruner={self.pruner!r}: one of {PRUNERS}.')
    for key, distribution in self.space.items():
      if isinstance(distribution, Choice):
        both = {k for keys in distribution.sets for k, _ in keys} & set(
            self.space)
        if both:
          raise ValueError(f'{key}: its presets set {sorted(both)}, which '
                           'the space also draws.')
    if not 1e-4 <= self.prune_after < 1 or self.startup_trials < 0:
      raise ValueError('prune_after in [1e-4, 1) and startup_trials >= 0.')

  def overrides(self, values: dict[str, Any]) -> dict[str, Any]:
    """The config overrides of a trial's `values` (a preset's name
    replaced by the keys it sets)."""
    overrides = {}
    for key, value in values.items():
      distribution = self.space[key]
      overrides |= (distribution.overrides(value)
                    if isinstance(distribution, Choice) and distribution.sets
                    else {key: value})
    return overrides

  def corners(self) -> list[dict[str, Any]]:
    """Overrides that reach every bound of every key (each key's bounds
    in turn, the others at their first): what validation checks."""
    first = {key: d.bounds[0] for key, d in self.space.items()}
    corners = [first]
    for key, distribution in self.space.items():
      corners += [first | {key: value} for value in distribution.bounds[1:]]
    return [self.overrides(corner) for corner in corners]

  def describe(self) -> dict[str, str]:
    """key -> the distribution, as a line of text."""
    def text(d: Distribution) -> str:
      if isinstance(d, Choice) and d.sets:
        return 'presets ' + '; '.join(
            f'{name}: ' + ', '.join(f'{k}={v}' for k, v in keys)
            for name, keys in zip(d.values, d.sets))
      if isinstance(d, Choice):
        return f'choice {list(d.values)}'
      scale = 'log-uniform' if d.log else 'uniform'
      kind = 'integer ' if isinstance(d, IntRange) else ''
      step = f' step {d.step}' if getattr(d, 'step', 1) != 1 else ''
      return f'{kind}{scale} in [{d.low:g}, {d.high:g}]{step}'
    return {key: text(d) for key, d in self.space.items()}

