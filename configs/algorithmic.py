r"""EncoderDecoder on an algorithmic task: copy, reverse, sort or addition.

  python -m train.train --config=configs/algorithmic.py:task=reverse \
      --workdir=workdirs/algorithmic_reverse

Results: docs/configs.md, `algorithmic.py`.
"""

from configs import default

TASKS = ('copy', 'reverse', 'sort', 'addition')


def get_config(arg: str = 'task=reverse'):
  """`arg` is `task=<name>`, one of TASKS."""
  task = default.choice(arg, 'task', TASKS, 'configs/algorithmic.py')
  config = default.get_config()
  config.dataset = 'algorithmic'
  config.dataset_options.task = task
  config.dataset_options.num_train = 100_000
  config.dataset_options.max_length = 40
  config.dataset_options.long_max_length = 400
  # Inputs are at most 40 symbols and an end token.
  config.seq_len = 48
  config.batch_size = 64
  config.num_train_steps = 2000
  config.learning_rate = 1e-3
  config.warmup_steps = 200
  config.eval_every = 500
  config.checkpoint_every = 500
  # Each evaluation also decodes (greedily) the first inputs of both splits:
  # those of the training lengths and the longer ones of `long`.
  config.decode_splits = ('validation', 'long')
  config.num_decode_examples = 64
  config.beam_size = 1

  config.model.family = 'encoder_decoder'
  config.model.vocab_size = 13  # Padding, end, 10 symbols and '+'.
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.num_layers = 2
  config.model.mlp_dim = 512
  config.model.max_len = config.seq_len
  return config
