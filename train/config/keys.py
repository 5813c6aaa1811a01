"""The training config's keys, all but `config.model` (model/config.py
declares that): what each means, its default, and the values it takes.
configs/default.py builds every config from KEYS and
train/config/validation.py checks each key by its rule, so no key is
written twice. A key without a rule is checked where it is read: the
dataset and its options by train/data/datasets.py, the decode splits by
config_validation, the mesh's keys by train/config/layout.py.
"""

from collections.abc import Callable
import dataclasses
from typing import Any

import ml_collections
from ml_collections import config_dict

from train.base.errors import did_you_mean
from train.program import optim, sharding

# (key, value) -> what is wrong with the value, or None.
Rule = Callable[[str, Any], str | None]


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


@dataclasses.dataclass(frozen=True)
class Key:
  # The default: a value, or a function making one (a fresh ConfigDict or
  # a typed placeholder for each config).
  default: Any
  rule: Rule | None = None

  def value(self) -> Any:
    return self.default() if callable(self.default) else self.default


INF = float('inf')

KEYS: dict[str, Key] = {
    # --- Data ---
    # Dataset name; see train/data/datasets.py for the list.
    'dataset': Key('python_stdlib_bytes'),
    # Options of that dataset (e.g. the algorithmic task, ListOps lengths).
    'dataset_options': Key(ml_collections.ConfigDict),
    # Where datasets are built (embedded ones) or prepared beforehand (tfds).
    'data_dir': Key('~/tensorflow_datasets', text()),
    # SentencePiece model for text datasets; None: train one from the
    # training split into workdir/sentencepiece.model, of
    # config.model.vocab_size.
    'vocab_path': Key(lambda: config_dict.placeholder(str),
                      text(optional=True)),
    # Tokens per row: the packed row length of LMs, the longest input (and
    # target) of the other kinds; longer examples are left out.
    'seq_len': Key(256, integer(1)),
    # Language models: pack several windows into a row, told apart by
    # segment ids (which need an attention that takes any mask); False puts
    # one window in a row, padded.
    'pack_sequences': Key(True, boolean),
    # Examples per optimizer step, over all devices and hosts.
    'batch_size': Key(32, integer(1)),
    # Split evaluated every `eval_every` steps.
    'eval_split': Key('validation', text()),
    # Batches per evaluation; -1 for the whole split.
    'num_eval_steps': Key(-1, integer(1, unless=-1)),

    # --- Optimization ---
    # Optimizer updates in the whole run.
    'num_train_steps': Key(1000, integer(1)),
    # adamw (Loshchilov & Hutter 2019) or sgd (with sgd_momentum).
    'optimizer': Key('adamw', one_of(optim.OPTIMIZERS)),
    # Peak learning rate, reached at the end of warmup.
    'learning_rate': Key(1e-3, number(0.0, INF, include_low=False)),
    # Steps of linear warmup from 0.
    'warmup_steps': Key(100, integer(0)),
    # After warmup: cosine, linear, rsqrt, constant or wsd (SCHEDULES in
    # train/program/optim.py).
    'schedule': Key('cosine', one_of(optim.SCHEDULES)),
    # End of cosine/linear/wsd decay, as a fraction of learning_rate.
    'final_learning_rate_fraction': Key(0.1, number(0.0, 1.0,
                                                    include_high=True)),
    # wsd: the last fraction of num_train_steps, decaying linearly from the
    # peak; the steps between warmup and it stay at the peak.
    'decay_fraction': Key(0.2, number(0.0, 1.0, include_low=False,
                                      include_high=True)),
    # Decay rate of adamw's first-moment (mean) estimate.
    'adam_b1': Key(0.9, number(0.0, 1.0)),
    # Decay rate of adamw's second-moment estimate.
    'adam_b2': Key(0.98, number(0.0, 1.0)),
    # Added to adamw's denominator for numerical stability.
    'adam_eps': Key(1e-9, number(0.0, INF, include_low=False)),
    # Momentum of sgd; 0 for none.
    'sgd_momentum': Key(0.9, number(0.0, 1.0)),
    # Decoupled weight decay of every weight, not of biases or
    # normalisation scales (model/weight_decay.py).
    'weight_decay': Key(0.01, number(0.0, INF)),
    # Clip gradients to this global norm; 0 for no clipping.
    'grad_clip_norm': Key(1.0, number(0.0, INF)),
    # Micro-batches per step: gradients of batch_size / grad_accum_steps
    # examples at a time are summed before one update.
    'grad_accum_steps': Key(1, integer(1)),
    # Probability mass spread uniformly over the vocabulary (or classes).
    'label_smoothing': Key(0.0, number(0.0, 1.0)),

    # --- Loop ---
    # Seeds initialisation, data order and dropout.
    'seed': Key(0, integer(0)),
    # Steps between training-metric summaries.
    'log_every': Key(50, integer(1)),
    # Steps between evaluations (and after the last step); 0: only at the
    # end.
    'eval_every': Key(500, integer(0)),
    # Steps between checkpoints (and after the last step); 0: only at the
    # end.
    'checkpoint_every': Key(500, integer(0)),
    # Checkpoints kept; older ones are deleted.
    'keep_checkpoints': Key(3, integer(1)),
    # A step whose loss or gradient is not finite: stop (name the step and
    # exit, the last checkpoint intact) or skip (drop that update, count it
    # in the metrics as skipped_steps).
    'nan_policy': Key('stop', one_of(('stop', 'skip'))),
    # skip: stop anyway after more than this many skipped steps in a row.
    'max_skipped_steps': Key(10, integer(0)),
    # Debugging: give the batch of this step a NaN weight, to see what
    # nan_policy does; 0 for none.
    'debug_poison_step': Key(0, integer(0)),

    # --- Language models: a sample printed at the end ---
    # Tokens to sample; 0 for no sample.
    'sample_length': Key(0, integer(0)),
    # Text the sample continues.
    'sample_prompt': Key('', text(empty=True)),
    # Softmax temperature of sampling; 0 is greedy.
    'sample_temperature': Key(0.8, number(0.0, INF)),

    # --- Sequence-to-sequence: decoding at each evaluation ---
    # Splits whose inputs are decoded at each evaluation: the exact match,
    # per-token accuracy and, for text, BLEU of what the model writes,
    # logged as decode_<split>_<score>, and what it wrote in
    # workdir/decoded/<split>.jsonl; () for none.
    'decode_splits': Key(()),
    # Examples decoded from each of those splits (its first ones); -1 for
    # all.
    'num_decode_examples': Key(256, integer(1, unless=-1)),
    # Hypotheses beam search keeps; 1 is greedy decoding.
    'beam_size': Key(4, integer(1)),
    # Length penalty exponent of beam search (Wu et al. 2016); 0 ranks by
    # log-probability alone.
    'beam_alpha': Key(0.6, number(0.0, INF)),

    # --- Devices (docs/scaling.md; train/program/mesh.py and sharding.py)
    # Mesh axis sizes, whose product is the number of devices of all hosts;
    # one of them may be -1 for the devices the others leave. data and fsdp
    # split the batch (fsdp the parameters too), tensor splits heads, MLP
    # units and vocabulary, sequence splits activations along the length
    # (with attention 'ring', keys and values travel round it).
    # strategy: pjit (jax.jit with shardings; any layout) or pmap (a
    # per-device program with an explicit gradient psum; data parallel
    # only). dcn_data: TPU slices the data axis spans (multi-slice); 1 for
    # one slice.
    'parallelism': Key(lambda: ml_collections.ConfigDict(dict(
        data=-1, fsdp=1, tensor=1, sequence=1, strategy='pjit',
        dcn_data=1))),
    # (logical axis name, mesh axis or tuple of them) pairs, tried in
    # order; names with no rule are not split. The defaults give data
    # parallelism, FSDP over embed and tensor parallelism over heads, mlp
    # and vocab.
    'logical_axis_rules': Key(sharding.DEFAULT_RULES),
    # Start jax.distributed, the cluster telling JAX the processes (Cloud
    # TPU, Slurm, ...). Also started by train.train's --coordinator_address
    # flag or the JAX_COORDINATOR_ADDRESS variable.
    'distributed': Key(False, boolean),
}


def problems(config: ml_collections.ConfigDict) -> list[str]:
  """What is wrong with each key that has a rule, one line each."""
  found = []
  for name, key in KEYS.items():
    if key.rule is not None:
      problem = key.rule(name, config[name])
      if problem:
        found.append(problem)
  return found
