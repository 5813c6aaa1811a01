r"""The length-generalisation study: each position scheme on copy, reverse
and addition, trained on inputs of 1-40 symbols, decoded on 41-400.

  python -m experiments.length_generalisation \
      --workdir=workdirs/length_generalisation \
      --out=experiments/results/length_generalisation

runs get_sweep() through experiments/sweep.py and scores each cell by input
length (experiments/length_generalisation.py). One cell alone:

  python -m train.train --config=configs/length_generalisation.py:task=copy \
      --config.model.position=rope --workdir=workdirs/copy_rope

Every cell has the same model (configs/algorithmic.py's encoder-decoder),
steps, seed and data; only the task and config.model.position change. The
settings below were fixed from the training lengths alone, before any long
input was decoded:
- relative_max_distance 32, under the 40 symbols of the longest training
  input: Shaw's clipped distances and T5's buckets then all have weights
  that training moved, where the default 128 would leave distances 41-128
  (Shaw) and T5's farthest buckets as initialised;
- max_len 1024, so that learned positions have a row for every position a
  long input and its output reach (the rows past 48 are never trained),
  and random_sinusoidal draws its training positions from [0, 1024);
- the final evaluation decodes greedily the first 192 inputs of each split
  (the long ones up to 1.5 times 401 tokens, plus 10).

Results: docs/configs.md, `length_generalisation.py`.
"""

from configs import algorithmic
from configs import grid

TASKS = ('copy', 'reverse', 'addition')
# Every scheme an encoder-decoder takes but deberta (a relative bias, as
# relative and t5_bias are), and random_sinusoidal, the remedy of Ruoss et
# al. (2023) for positions never seen in training.
POSITIONS = ('none', 'sinusoidal', 'learned', 'relative', 't5_bias', 'rope',
             'alibi', 'random_sinusoidal')


def get_config(arg: str = 'task=reverse'):
  """`arg` is `task=<name>`, one of configs/algorithmic.py's TASKS."""
  config = algorithmic.get_config(arg)
  config.num_train_steps = 800
  config.warmup_steps = 100
  config.eval_every = config.num_train_steps  # Decode once, at the end.
  config.checkpoint_every = 200
  config.decode_splits = ('validation', 'long')
  config.num_decode_examples = 192
  config.beam_size = 1
  config.model.relative_max_distance = 32
  config.model.max_len = 1024
  return config


def get_sweep():
  """Every task x position scheme: 24 cells."""
  return grid.product(**{'dataset_options.task': list(TASKS),
                         'model.position': list(POSITIONS)})
