"""The training config: every key but `config.model` (model/config.py
declares that), with its type, its default, the rule its value must pass
and what it means.

A user writes a `ml_collections.ConfigDict` (configs/default.py builds one
from these fields, then each experiment changes what it needs); once
train/config/validation.py has checked it, `TrainConfig.from_config` makes
it this frozen dataclass, and everything after validation reads that.
A key without a rule here is checked against what it names: the dataset
(and its options) by train/data/datasets.py, the schedule and the optimizer by
train/program/optim.py's SCHEDULES and OPTIMIZERS, the mesh's sizes by
train/program/mesh.py.
"""

from collections.abc import Callable, Mapping
import dataclasses
import typing
from typing import Any

import flax.core
import ml_collections
from ml_collections import config_dict

from model.attention.core import logical_axes
from model.config import ModelConfig
from train.base.errors import did_you_mean

# (key, value) -> what is wrong with the value, or None.
Rule = Callable[[str, Any], str | None]

# The axes of the device mesh, always in this order (train/program/mesh.py
# says what each does), and those that split the batch.
MESH_AXES = ('data', 'fsdp', 'tensor', 'sequence')
BATCH_AXES = ('data', 'fsdp')


def integer(minimum: int, *, unless: int | None = None) -> Rule:
  """An integer >= `minimum` (or exactly `unless`, a value meaning 'all')."""
  def rule(key, value):
    whole = isinstance(value, int) and not isinstance(value, bool)
    if whole and (value >= minimum or value == unless):
      return None
    return f'config.{key}={value!r} must be an integer >= {minimum}.'
  return rule


def number(low: float, high: float, *, include_low: bool = True,
           include_high: bool = False) -> Rule:
  """A number in the interval from `low` to `high`."""
  def rule(key, value):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and (value >= low if include_low else value > low) and (
        value <= high if include_high else value < high):
      return None
    interval = (('[' if include_low else '(') + f'{low}, {high}'
                + (']' if include_high else ')'))
    return f'config.{key}={value!r} must be a number in {interval}.'
  return rule


def text(*, empty: bool = False, optional: bool = False) -> Rule:
  """A string (non-empty unless `empty`; or None if `optional`)."""
  def rule(key, value):
    if (optional and value is None) or (
        isinstance(value, str) and (empty or value)):
      return None
    return (f'config.{key}={value!r} must be a'
            f'{"" if empty else " non-empty"} string.')
  return rule


def sha256(key: str, value) -> str | None:
  """A sha256 as 64 lowercase hex digits, or '' for none."""
  if value == '' or (isinstance(value, str) and len(value) == 64
                     and set(value) <= set('0123456789abcdef')):
    return None
  return (f'config.{key}={value!r} must be a sha256 (64 lowercase hex '
          "digits) or ''.")


def local_path(key: str, value) -> str | None:
  """A path on this machine (which may be where a bucket is mounted)."""
  problem = text()(key, value)
  if problem or '://' not in value:
    return problem
  return (f'config.{key}={value!r}: datasets are array_record files, whose '
          'reader opens local paths only; mount the bucket (gcsfuse) and '
          "give the mount's path.")


def one_of(choices) -> Rule:
  def rule(key, value):
    if value in choices:
      return None
    return (f'config.{key}={value!r} must be one of {list(choices)}'
            f'{did_you_mean(value, choices)}')
  return rule


def boolean(key: str, value) -> str | None:
  if isinstance(value, bool):
    return None
  return f'config.{key}={value!r} must be True or False.'


def names(key: str, value) -> str | None:
  """A tuple of non-empty names (of splits)."""
  if isinstance(value, (tuple, list)) and all(
      isinstance(name, str) and name for name in value):
    return None
  return f'config.{key}={value!r} must be a tuple of split names.'


def step_windows(key: str, value) -> str | None:
  """(step, window) pairs of positive integers (train/program/windows.py
  checks them against the model and the run)."""
  try:
    pairs = [(step, window) for step, window in value]
  except (TypeError, ValueError):
    pairs = None
  if pairs is not None and all(
      isinstance(x, int) and not isinstance(x, bool) and x > 0
      for pair in pairs for x in pair):
    return None
  return (f'config.{key}={value!r} must be (step, window) pairs of '
          'positive integers, e.g. ((300, 64), (600, 128)).')


def axis_rules(key: str, value) -> str | None:
  """(logical name, mesh axis or tuple of mesh axes or None) pairs."""
  try:
    pairs = tuple((name, target) for name, target in value)
  except (TypeError, ValueError):
    return (f'config.{key}={value!r} must be a sequence of (logical name, '
            'mesh axis or tuple of mesh axes) pairs.')
  for name, target in pairs:
    axes = (() if target is None else (target,) if isinstance(target, str)
            else target)
    if not isinstance(name, str) or not isinstance(axes, (tuple, list)) or (
        any(axis not in MESH_AXES for axis in axes)):
      return (f'config.{key}: ({name!r}, {target!r}) must map a name to '
              f'mesh axes among {list(MESH_AXES)}.')
  return None


def key(default: Any = dataclasses.MISSING, rule: Rule | None = None, *,
        factory: Callable[[], Any] | None = None):
  """A field of the training config: its default (or a `factory` making
  one) and the rule its value passes."""
  if factory is not None:
    return dataclasses.field(default_factory=factory, metadata={'rule': rule})
  return dataclasses.field(default=default, metadata={'rule': rule})


INF = float('inf')


@dataclasses.dataclass(frozen=True)
class Parallelism:
  """`config.parallelism`: the mesh (docs/scaling.md; train/program/mesh.py
  and sharding.py). The axis sizes multiply to the number of devices of
  all hosts; one of them may be -1 for the devices the others leave."""

  # The batch split over replicas.
  data: int = -1
  # The batch split, and every parameter along its embed dim.
  fsdp: int = 1
  # Heads, MLP units and vocabulary split.
  tensor: int = 1
  # Activations split along the length (with attention 'ring', keys and
  # values travel round it).
  sequence: int = 1
  # pjit (jax.jit with shardings; any layout) or pmap (a per-device
  # program with an explicit gradient psum; data parallel only).
  strategy: str = 'pjit'
  # TPU slices the data axis spans (multi-slice); 1 for one slice.
  dcn_data: int = 1


def group(cls) -> Rule:
  """A group of keys: those of dataclass `cls` and no others, or any for
  `cls` None."""
  known = cls and [field.name for field in dataclasses.fields(cls)]

  def rule(key, value):
    if not isinstance(value, (Mapping, ml_collections.ConfigDict)):
      return (f'config.{key}={value!r} must be a group of keys'
              + (f' {known}.' if known else '.'))
    for name in value if known else ():
      if name not in known:
        return (f'unknown key config.{key}.{name}; known keys: {known}'
                f'{did_you_mean(name, known)}')
    return None
  return rule


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A checked training config (see the module docstring)."""

  # --- Data ---
  # Dataset name; see train/data/datasets.py for the list.
  dataset: str = key('python_stdlib_bytes')
  # Options of that dataset (e.g. the algorithmic task, ListOps lengths;
  # train/data/datasets.py checks them). An unset one (None): its default.
  dataset_options: Mapping[str, Any] = key(
      rule=group(None), factory=flax.core.FrozenDict)
  # Where datasets are built (embedded ones) or prepared beforehand (tfds).
  # A local path (array_record reads no URL; a mounted bucket serves).
  data_dir: str = key('~/tensorflow_datasets', local_path)
  # SentencePiece model for text datasets; None: train one from the
  # training split into workdir/sentencepiece.model, of
  # config.model.vocab_size.
  vocab_path: str | None = key(None, text(optional=True))
  # A language model's text tokenized by a Hugging Face tokenizer.json (or
  # a directory holding one: an import's workdir) instead of the dataset's
  # own (bytes): python_stdlib_bytes and text_files. None: the dataset's.
  # A run copies it into its workdir, whose config.json names the copy,
  # relative to the workdir (train/run/portable.py).
  tokenizer: str | None = key(None, text(optional=True))
  # The fingerprint (sha256, 64 hex digits) of the corpus that this
  # config's track is measured on: a python_stdlib_bytes or text_files
  # build's corpus_sha256 (train/data/stdlib.py). A run on another corpus
  # says at its end that it is off the track: its figures are not
  # comparable with the track's records (experiments/results/speedrun/).
  # '': no track.
  track_corpus: str = key('', sha256)
  # Tokens per row: the packed row length of LMs, the longest input (and
  # target) of the other kinds; longer examples are left out.
  seq_len: int = key(256, integer(1))
  # Language models: pack several windows into a row, told apart by
  # segment ids (which need an attention that takes any mask); False puts
  # one window in a row, padded.
  pack_sequences: bool = key(True, boolean)
  # Examples per optimizer step, over all devices and hosts.
  batch_size: int = key(32, integer(1))
  # Split evaluated every `eval_every` steps.
  eval_split: str = key('validation', text())
  # Batches per evaluation; -1 for the whole split.
  num_eval_steps: int = key(-1, integer(1, unless=-1))

  # --- Optimization ---
  # Optimizer updates in the whole run.
  num_train_steps: int = key(1000, integer(1))
  # The long sliding windows growing in training (the modded-nanogpt
  # records): ((step, window), ...), the longest windows of the windowed
  # layers (local) being each `window` before its `step`, and the model's
  # own from the last step on (train/program/windows.py); () for none.
  window_schedule: tuple[tuple[int, int], ...] = key((), step_windows)
  # The parameters the optimizer moves: all, or the self-attention layers'
  # alone (their projections, norms and a variant's own parameters), the
  # rest frozen (fine-tuning a transplanted attention).
  trained_params: str = key('all', one_of(('all', 'attention')))
  # adamw (Loshchilov & Hutter 2019), sgd (with sgd_momentum), or muon
  # (Jordan et al. 2024): Muon on the hidden matrices (model/matrices.py)
  # at muon_learning_rate, AdamW at learning_rate on every other parameter
  # (OPTIMIZERS in train/program/optim.py); or normuon (Li et al. 2025):
  # muon with each neuron's update normalised (normuon_beta2).
  optimizer: str = key('adamw')
  # Peak learning rate, reached at the end of warmup.
  learning_rate: float = key(1e-3, number(0.0, INF, include_low=False))
  # Steps of linear warmup from 0.
  warmup_steps: int = key(100, integer(0))
  # After warmup: cosine, linear, rsqrt, constant or wsd (SCHEDULES in
  # train/program/optim.py).
  schedule: str = key('cosine')
  # End of cosine/linear/wsd decay, as a fraction of learning_rate.
  final_learning_rate_fraction: float = key(
      0.1, number(0.0, 1.0, include_high=True))
  # wsd: the last fraction of num_train_steps, decaying linearly from the
  # peak; the steps between warmup and it stay at the peak.
  decay_fraction: float = key(
      0.2, number(0.0, 1.0, include_low=False, include_high=True))
  # Decay rate of adamw's first-moment (mean) estimate.
  adam_b1: float = key(0.9, number(0.0, 1.0))
  # Decay rate of adamw's second-moment estimate.
  adam_b2: float = key(0.98, number(0.0, 1.0))
  # Added to adamw's denominator for numerical stability.
  adam_eps: float = key(1e-9, number(0.0, INF, include_low=False))
  # Muon's peak learning rate, on the same schedule as learning_rate. Its
  # matrices' weight decay is decoupled and scaled by it (each step takes
  # muon_learning_rate * weight_decay of a matrix, as in Muon's reference
  # code), so the same weight_decay is muon_learning_rate / learning_rate
  # times stronger on them than on AdamW's weights.
  muon_learning_rate: float = key(0.02, number(0.0, INF, include_low=False))
  # Muon's (Nesterov) momentum.
  muon_momentum: float = key(0.95, number(0.0, 1.0))
  # normuon: the decay of each neuron's running mean square of Muon's
  # direction, by whose root that neuron's update is divided.
  normuon_beta2: float = key(0.95, number(0.0, 1.0))
  # Momentum of sgd; 0 for none.
  sgd_momentum: float = key(0.9, number(0.0, 1.0))
  # Decoupled weight decay of every weight, not of biases or
  # normalisation scales (model/weight_decay.py).
  weight_decay: float = key(0.01, number(0.0, INF))
  # Cautious weight decay (Chen et al. 2025): a weight decays only where
  # the optimizer's direction (what the step subtracts) and the weight
  # agree in sign, so that decay never pulls against the step. adamw,
  # muon and normuon.
  cautious_weight_decay: bool = key(False, boolean)
  # Clip gradients to this global norm; 0 for no clipping.
  grad_clip_norm: float = key(1.0, number(0.0, INF))
  # Micro-batches per step: gradients of batch_size / grad_accum_steps
  # examples at a time are summed before one update.
  grad_accum_steps: int = key(1, integer(1))
  # Optimizer steps per call of the compiled program: K consecutive
  # batches, placed on the devices, are stacked into one [K, batch_size,
  # ...] array and one call runs K updates in a lax.scan, each the computation of a call of
  # its own (same dropout keys, schedule, skips, memory); fewer Python
  # dispatches, launches and metric transfers keep a small model's
  # accelerator busy. Results are bitwise those of K calls where XLA
  # compiles the step alike in both programs (the tested language models
  # on the CPU); elsewhere a reduction may round differently in the last
  # bit. log_every, eval_every and checkpoint_every must be multiples of
  # it; steps before the first multiple of K (a run resumed at another K)
  # and after the last run one at a time (a program of their own).
  steps_per_call: int = key(1, integer(1))
  # Probability mass spread uniformly over the vocabulary (or classes).
  label_smoothing: float = key(0.0, number(0.0, 1.0))
  # z-loss: each token's training loss adds z_loss * (log Z)^2, Z the
  # output softmax's normaliser (PaLM, Chowdhery et al. 2022); 0: none.
  z_loss: float = key(0.0, number(0.0, 1.0))

  # --- Loop ---
  # Seeds initialisation, data order and dropout.
  seed: int = key(0, integer(0))
  # A run's workdir (its latest verified checkpoint) or one checkpoint
  # (WORKDIR/checkpoints/STEP) whose parameters this run starts from, in
  # place of fresh ones, when its own workdir has no checkpoint yet: any
  # config.model change that keeps the parameters' shapes, plus fewer key/
  # value heads (mean-pooled, Ainslie et al. 2023); parameters new to the
  # model start fresh (train/run/init_from.py). None: a fresh start.
  init_from: str | None = key(None, text(optional=True))
  # Steps between training-metric summaries.
  log_every: int = key(50, integer(1))
  # Steps between evaluations (and after the last step); 0: only at the
  # end.
  eval_every: int = key(500, integer(0))
  # Steps between checkpoints (and after the last step); 0: only at the
  # end.
  checkpoint_every: int = key(500, integer(0))
  # Checkpoints kept; older ones are deleted.
  keep_checkpoints: int = key(3, integer(1))
  # A step whose loss or gradient is not finite: stop (name the step and
  # exit, the last checkpoint intact) or skip (drop that update, count it
  # in the metrics as skipped_steps).
  nan_policy: str = key('stop', one_of(('stop', 'skip')))
  # skip: stop anyway after more than this many skipped steps in a row.
  max_skipped_steps: int = key(10, integer(0))
  # Debugging: give the batch of this step a NaN weight, to see what
  # nan_policy does; 0 for none.
  debug_poison_step: int = key(0, integer(0))

  # --- Language models: a sample printed at the end ---
  # Tokens to sample; 0 for no sample.
  sample_length: int = key(0, integer(0))
  # Text the sample continues.
  sample_prompt: str = key('', text(empty=True))
  # Softmax temperature of sampling; 0 is greedy.
  sample_temperature: float = key(0.8, number(0.0, INF))

  # --- Sequence-to-sequence: decoding at each evaluation ---
  # Splits whose inputs are decoded at each evaluation: the exact match,
  # per-token accuracy and, for text, BLEU of what the model writes,
  # logged as decode_<split>_<score>, and what it wrote in
  # workdir/decoded/<split>.jsonl; () for none.
  decode_splits: tuple[str, ...] = key((), names)
  # Examples decoded from each of those splits (its first ones); -1 for
  # all.
  num_decode_examples: int = key(256, integer(1, unless=-1))
  # Hypotheses beam search keeps; 1 is greedy decoding.
  beam_size: int = key(4, integer(1))
  # Length penalty exponent of beam search (Wu et al. 2016); 0 ranks by
  # log-probability alone.
  beam_alpha: float = key(0.6, number(0.0, INF))

  # --- Devices (docs/scaling.md; train/program/mesh.py and sharding.py)
  # The mesh's axis sizes and strategy (Parallelism above).
  parallelism: Parallelism = key(Parallelism(), group(Parallelism))
  # (logical axis name, mesh axis or tuple of them) pairs, tried in
  # order; names with no rule are not split. The defaults give data
  # parallelism, FSDP over embed and tensor parallelism over heads, mlp
  # and vocab.
  logical_axis_rules: tuple[tuple[str, Any], ...] = key((
      (logical_axes.BATCH, BATCH_AXES),
      (logical_axes.LENGTH, 'sequence'),
      ('embed', 'fsdp'),
      (logical_axes.HEADS, 'tensor'),
      (logical_axes.KV_HEADS, 'tensor'),
      ('mlp', 'tensor'),
      ('vocab', 'tensor'),
  ), axis_rules)
  # Start jax.distributed, the cluster telling JAX the processes (Cloud
  # TPU, Slurm, ...). Also started by train.train's --coordinator_address
  # flag or the JAX_COORDINATOR_ADDRESS variable.
  distributed: bool = key(False, boolean)

  # --- The model (model/config.py) ---
  model: ModelConfig = key(ModelConfig())

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict,
                  model: ModelConfig | None = None) -> 'TrainConfig':
    """The TrainConfig of `config`, with `model` (default: built from
    `config.model`). A value missing or breaking its key's rule becomes
    the key's default, so that the checks combining keys read sound
    values: validation, which reports it, raises before such a config
    goes on."""
    values = {}
    for field in dataclasses.fields(cls):
      if field.name == 'model':
        values['model'] = model or ModelConfig.from_mapping(config.model)
        continue
      if field.name not in config:
        values[field.name] = _default(field)
        continue
      value = config[field.name]
      if hasattr(value, 'to_dict'):  # An ml_collections ConfigDict.
        value = value.to_dict()
      rule = field.metadata['rule']
      if rule and rule(field.name, value):
        value = _default(field)
      elif field.name in _CONVERT:
        value = _CONVERT[field.name](value)
      values[field.name] = value
    return cls(**values)


# How the ConfigDict's values of some keys become TrainConfig's.
_CONVERT = {
    'parallelism': lambda value: Parallelism(**value),
    # An option left unset (None) takes the dataset's default.
    'dataset_options': lambda options: flax.core.FrozenDict(
        {key: value for key, value in options.items() if value is not None}),
    'decode_splits': tuple,
    'window_schedule': lambda pairs: tuple(tuple(pair) for pair in pairs),
    # JSON (config.json) holds the tuples of mesh axes as lists.
    'logical_axis_rules': lambda rules: tuple(
        (name, tuple(target) if isinstance(target, list) else target)
        for name, target in rules),
}


def _default(field: dataclasses.Field) -> Any:
  return (field.default_factory() if field.default is dataclasses.MISSING
          else field.default)


def defaults() -> ml_collections.ConfigDict:
  """Every training key at its default, as a ConfigDict (without
  `config.model`: configs/default.py adds it)."""
  values = {}
  for field in dataclasses.fields(TrainConfig):
    if field.name == 'model':
      continue
    value = _default(field)
    if dataclasses.is_dataclass(value):
      value = ml_collections.ConfigDict(dataclasses.asdict(value))
    elif isinstance(value, Mapping):
      value = ml_collections.ConfigDict(dict(value))
    elif value is None:  # A typed placeholder lets `--config.KEY=...` parse.
      [kind] = [arg for arg in typing.get_args(field.type)
                if arg is not type(None)]
      value = config_dict.placeholder(kind)
    values[field.name] = value
  return ml_collections.ConfigDict(values)


def problems(config: ml_collections.ConfigDict,
             rules: Mapping[str, Rule] | None = None) -> list[str]:
  """What is wrong with each key by its rule (or by `rules`, for keys
  whose values name what train/base cannot import), each key missing and
  each that is not one of TrainConfig's, one line each, in key order."""
  fields = {field.name: field for field in dataclasses.fields(TrainConfig)}
  found = []
  for name in config:
    if name not in fields:
      found.append(f'unknown key config.{name}{did_you_mean(name, fields)}')
  for name, field in fields.items():
    rule = (rules or {}).get(name, field.metadata['rule'])
    if name not in config:
      found.append(f'config.{name} is missing: a config starts from '
                   "configs/default.py's get_config().")
    elif rule is not None:
      problem = rule(name, config[name])
      if problem:
        found.append(problem)
  return found
