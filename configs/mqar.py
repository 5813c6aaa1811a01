r"""DecoderLM on multi-query associative recall (MQAR), the task that tells
fixed-state recurrences from attention (Zoology, Arora et al. 2023).

  python -m train.train --config=configs/mqar.py --workdir=workdirs/mqar
  python -m train.train --config=configs/mqar.py:length=128,pairs=16 \
      --config.model.d_model=128 --workdir=workdirs/mqar_128_16
  python -m experiments.compare_attention --config=configs/mqar.py \
      --variants=dense,linear,gla,deltanet --seeds=3 --workdir=DIR

`arg` gives the cell of the grid: `length` (tokens of an example, the
config's seq_len too) and `pairs` (key-value pairs, each asked once), by
default length=64,pairs=8; the width is config.model.d_model. The quality
metric is eval_accuracy: the fraction of answers right (train/data/mqar.py
says what an example holds).

Zoology's grid (its figure 2): vocabulary 8192; (length, pairs) (64, 4),
(128, 8), (256, 16) (and (512, 64)); d_model 64, 128, 256 and 512; 2 layers
of sequence mixing without MLPs (attention with one head and dropout 0.1);
learning rates 1e-4 to 1e-2 (4, log-spaced); 100,000 training examples,
3,000 test ones, 64 epochs, batches of 512 / 256 / 128 by length; gaps
drawn with power_a 0.01, and the tokens between queries left 0 in that
figure (random here, its generator's default, so a filler may repeat a
key).

The reduced grid this 2-core CPU runs (the defaults below): vocabulary
256; (length, pairs) (64, 8) and (128, 16), so the pairs grow with the
length and fill a quarter of the tokens; d_model 64 and 128, 2 layers of
2 heads with MLPs of twice the width, rotary positions; one learning rate
(3e-3, warmed up over 100 steps, then a cosine decay); 20,000 training
examples, 1,000 test ones, 2,000 steps of 64 (about 6 epochs). A dense
model of width 64 at (64, 8) trained 3,000 steps passed 0.98 of the
answers by step 1,500 and 0.999 by 2,000; at vocabulary 512 and 2e-3 it had
0.15 right after 3,000, little more than picking one of the 8 values
given (0.125).
"""

from configs import default

LENGTH, PAIRS = 64, 8


def cell(arg: str) -> tuple[int, int]:
  """(length, pairs) of `arg`: '' or 'length=L,pairs=P' (either alone); a
  ValueError naming this file otherwise."""
  values = {'length': LENGTH, 'pairs': PAIRS}
  for item in filter(None, arg.split(',')):
    key, _, value = item.partition('=')
    if key not in values or not value.isdigit():
      raise ValueError(f'configs/mqar.py takes length=<int>,pairs=<int>, got '
                       f'{arg!r}.')
    values[key] = int(value)
  return values['length'], values['pairs']


def get_config(arg: str = ''):
  length, pairs = cell(arg)
  config = default.get_config()
  config.dataset = 'mqar'
  config.dataset_options.vocab_size = 256
  config.dataset_options.length = length
  config.dataset_options.num_pairs = pairs
  config.dataset_options.num_train = 20_000
  config.dataset_options.num_eval = 1_000
  config.seq_len = length
  config.pack_sequences = False
  config.batch_size = 64
  config.num_train_steps = 2000
  config.learning_rate = 3e-3
  config.warmup_steps = 100
  config.eval_every = 500
  config.checkpoint_every = 500
  config.sample_length = 0

  config.model.family = 'decoder_lm'
  config.model.vocab_size = 256
  config.model.d_model = 64
  config.model.num_heads = 2
  config.model.num_layers = 2
  config.model.mlp_dim = 128
  config.model.position = 'rope'
  config.model.max_len = length
  return config
