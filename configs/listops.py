r"""EncoderClassifier on ListOps; `:full` is the Long Range Arena setting.

  python -m train.train --config=configs/listops.py --workdir=workdirs/listops
  python -m train.train --config=configs/listops.py:full \
      --workdir=workdirs/listops_full
  python -m experiments.sweep --config=configs/listops.py \
      --workdir=workdirs/listops_sweep --parallel=2

Results: docs/configs.md, `listops.py`.
"""

from configs import default
from configs import search


def get_config(arg: str = ''):
  """`arg` is '' (short expressions, for the CPU) or 'full' (LRA)."""
  if arg not in ('', 'full'):
    raise ValueError(f"configs/listops.py takes '' or 'full', got {arg!r}.")
  config = default.get_config()
  config.dataset = 'listops'
  config.model.family = 'encoder_classifier'
  config.model.vocab_size = 17  # Padding, 10 digits, 4 operators, ']'.
  config.model.num_classes = 10
  config.model.pooling = 'cls'
  config.model.position = 'learned'
  if arg == 'full':
    config.dataset_options.min_length = 500
    config.dataset_options.max_length = 2000
    config.dataset_options.num_train = 96_000
    config.dataset_options.num_eval = 2_000
    config.seq_len = 2000
    config.batch_size = 32
    config.num_train_steps = 5000
    config.learning_rate = 5e-4
    config.warmup_steps = 1000
    config.model.d_model = 512
    config.model.num_heads = 8
    config.model.num_layers = 4
    config.model.mlp_dim = 1024
    config.model.dropout_rate = 0.1
  else:
    config.dataset_options.min_length = 16
    config.dataset_options.max_length = 128
    config.dataset_options.num_train = 20_000
    config.dataset_options.num_eval = 1_000
    config.seq_len = 128
    config.batch_size = 32
    config.num_train_steps = 2000
    config.learning_rate = 1e-3
    config.warmup_steps = 200
    config.model.d_model = 128
    config.model.num_heads = 4
    config.model.num_layers = 2
    config.model.mlp_dim = 512
  config.eval_every = 500
  config.checkpoint_every = 500
  # One more position for the CLS vector.
  config.model.max_len = config.seq_len + 1
  return config


def get_sweep():
  """A search of the learning rate, warmup and dropout, for `python -m
  experiments.sweep`: 10 trials, those behind the median at an evaluation
  (from a quarter of their steps on, once 3 trials finished) pruned."""
  return search.Space(
      {'learning_rate': search.log_uniform(2e-4, 5e-3),
       'warmup_steps': search.int_range(0, 400, step=50),
       'model.dropout_rate': search.uniform(0.0, 0.2)},
      trials=10, metric='eval_accuracy', mode='max', prune_after=0.25)
