"""Defaults shared by every experiment config.

Each experiment's `get_config()` starts from `get_config()` here and
overrides only what it changes. The meaning of every `config.model` key is
documented beside its field in `model/config.py`.
"""

import dataclasses

import ml_collections
from ml_collections import config_dict

from model.config import ModelConfig
from train import sharding


def choice(arg: str, key: str, choices: tuple[str, ...], path: str) -> str:
  """The name of a config argument `key=<name>`, one of `choices`; a
  ValueError naming the config file `path` otherwise."""
  given, _, name = arg.partition('=')
  if given != key or name not in choices:
    raise ValueError(f'{path} takes {key}=<one of {choices}>, got {arg!r}.')
  return name


def model_defaults() -> ml_collections.ConfigDict:
  """`config.model`: every ModelConfig field at its default."""
  values = {}
  for field in dataclasses.fields(ModelConfig):
    # The optional fields (num_kv_heads, head_dim) are ints that default to
    # None; a typed placeholder lets `--config.model.head_dim=64` parse.
    values[field.name] = (config_dict.placeholder(int) if field.default is None
                          else field.default)
  # Options are named per variant, e.g. config.model.attention_options.window.
  values['attention_options'] = ml_collections.ConfigDict()
  # Mixture of experts, e.g. config.model.moe.num_experts (0: off).
  values['moe'] = ml_collections.ConfigDict(
      dataclasses.asdict(ModelConfig().moe))
  return ml_collections.ConfigDict(values)


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # --- Data ---
  # Dataset name; see train/data/datasets.py for the list.
  config.dataset = 'python_stdlib_bytes'
  # Options of that dataset (e.g. the algorithmic task, ListOps lengths).
  config.dataset_options = ml_collections.ConfigDict()
  # Where datasets are built (embedded ones) or prepared beforehand (tfds).
  config.data_dir = '~/tensorflow_datasets'
  # SentencePiece model for text datasets; None: train one from the training
  # split into workdir/sentencepiece.model, of config.model.vocab_size.
  config.vocab_path = config_dict.placeholder(str)
  # Tokens per row: the packed row length of LMs, the longest input (and
  # target) of the other kinds; longer examples are left out.
  config.seq_len = 256
  # Language models: pack several windows into a row, told apart by
  # segment ids (which need an attention that takes any mask); False puts
  # one window in a row, padded.
  config.pack_sequences = True
  # Examples per optimizer step, over all devices and hosts.
  config.batch_size = 32
  # Split evaluated every `eval_every` steps.
  config.eval_split = 'validation'
  # Batches per evaluation; -1 for the whole split.
  config.num_eval_steps = -1

  # --- Optimization ---
  # Optimizer updates in the whole run.
  config.num_train_steps = 1000
  # adamw (Loshchilov & Hutter 2019) or sgd (with sgd_momentum).
  config.optimizer = 'adamw'
  # Peak learning rate, reached at the end of warmup.
  config.learning_rate = 1e-3
  # Steps of linear warmup from 0.
  config.warmup_steps = 100
  # After warmup: cosine, linear, rsqrt or constant (train/optim.py).
  config.schedule = 'cosine'
  # End of cosine/linear decay, as a fraction of learning_rate.
  config.final_learning_rate_fraction = 0.1
  # Decay rate of adamw's first-moment (mean) estimate.
  config.adam_b1 = 0.9
  # Decay rate of adamw's second-moment estimate.
  config.adam_b2 = 0.98
  # Added to adamw's denominator for numerical stability.
  config.adam_eps = 1e-9
  # Momentum of sgd; 0 for none.
  config.sgd_momentum = 0.9
  # Decoupled weight decay of every weight, not of biases or normalisation
  # scales (model/weight_decay.py).
  config.weight_decay = 0.01
  # Clip gradients to this global norm; 0 for no clipping.
  config.grad_clip_norm = 1.0
  # Micro-batches per step: gradients of batch_size / grad_accum_steps
  # examples at a time are summed before one update.
  config.grad_accum_steps = 1
  # Probability mass spread uniformly over the vocabulary (or classes).
  config.label_smoothing = 0.0

  # --- Loop ---
  # Seeds initialisation, data order and dropout.
  config.seed = 0
  # Steps between training-metric summaries.
  config.log_every = 50
  # Steps between evaluations (and after the last step); 0: only at the end.
  config.eval_every = 500
  # Steps between checkpoints (and after the last step); 0: only at the end.
  config.checkpoint_every = 500
  # Checkpoints kept; older ones are deleted.
  config.keep_checkpoints = 3
  # A step whose loss or gradient is not finite: stop (name the step and
  # exit, the last checkpoint intact) or skip (drop that update, count it
  # in the metrics as skipped_steps).
  config.nan_policy = 'stop'
  # skip: stop anyway after more than this many skipped steps in a row.
  config.max_skipped_steps = 10
  # Debugging: give the batch of this step a NaN weight, to see what
  # nan_policy does; 0 for none.
  config.debug_poison_step = 0

  # --- Language models: a sample printed at the end ---
  # Tokens to sample; 0 for no sample.
  config.sample_length = 0
  # Text the sample continues.
  config.sample_prompt = ''
  # Softmax temperature of sampling; 0 is greedy.
  config.sample_temperature = 0.8

  # --- Sequence-to-sequence: decoding at each evaluation ---
  # Splits whose inputs are decoded at each evaluation: the exact match,
  # per-token accuracy and, for text, BLEU of what the model writes, logged
  # as decode_<split>_<score>; () for none.
  config.decode_splits = ()
  # Examples decoded from each of those splits (its first ones); -1 for all.
  config.num_decode_examples = 256
  # Hypotheses beam search keeps; 1 is greedy decoding.
  config.beam_size = 4
  # Length penalty exponent of beam search (Wu et al. 2016); 0 ranks by
  # log-probability alone.
  config.beam_alpha = 0.6

  # --- Devices (README 'Scaling out'; train/mesh.py, train/sharding.py) ---
  # Mesh axis sizes, whose product is the number of devices of all hosts;
  # one of them may be -1 for the devices the others leave. data and fsdp
  # split the batch (fsdp the parameters too), tensor splits heads, MLP
  # units and vocabulary, sequence splits activations along the length
  # (with attention 'ring', keys and values travel round it).
  # strategy: pjit (jax.jit with shardings; any layout) or pmap (a
  # per-device program with an explicit gradient psum; data parallel only).
  # dcn_data: TPU slices the data axis spans (multi-slice); 1 for one slice.
  config.parallelism = ml_collections.ConfigDict(dict(
      data=-1, fsdp=1, tensor=1, sequence=1, strategy='pjit', dcn_data=1))
  # (logical axis name, mesh axis or tuple of them) pairs, tried in order;
  # names with no rule are not split. The defaults give data parallelism,
  # FSDP over embed and tensor parallelism over heads, mlp and vocab.
  config.logical_axis_rules = sharding.DEFAULT_RULES
  # Start jax.distributed, the cluster telling JAX the processes (Cloud TPU,
  # Slurm, ...). Also started by train.train's --coordinator_address flag or
  # the JAX_COORDINATOR_ADDRESS variable.
  config.distributed = False

  # The model: see model/config.py for each key.
  config.model = model_defaults()
  return config
