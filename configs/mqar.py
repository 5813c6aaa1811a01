r"""DecoderLM on multi-query associative recall (MQAR), the task that tells
fixed-state recurrences from attention (Zoology, Arora et al. 2023).

  python -m train.train --config=configs/mqar.py --workdir=workdirs/mqar
  python -m train.train --config=configs/mqar.py:length=128,pairs=16 \
      --config.model.d_model=128 --workdir=workdirs/mqar_128_16
  python -m experiments.compare_attention --config=configs/mqar.py \
      --variants=dense,linear,gla,deltanet --seeds=3 --workdir=DIR

`arg` gives the cell of the grid: `length` (tokens of an example, the
config's seq_len too) and `pairs` (key-value pairs, each asked once), by
default length=64,pairs=4; the width is config.model.d_model. The quality
metric is eval_accuracy: the fraction of answers right (train/data/mqar.py
says what an example holds).

Zoology's grid (its figure 2): vocabulary 8192; (length, pairs) (64, 4),
(128, 8), (256, 16) (and (512, 64)); d_model 64, 128, 256 and 512; 2 layers
of sequence mixing without MLPs (attention with one head and dropout 0.1);
learning rates 1e-4 to 1e-2 (4, log-spaced); 100,000 training examples,
3,000 test ones, 64 epochs, batches of 512 / 256 / 128 by length; gaps
drawn with power_a 0.01, and the tokens between queries left 0 in that
figure (random here, its generator's default, so a filler may repeat a
key; dataset_options.random_fillers=False leaves them 0).

The reduced grid this 2-core CPU runs (the defaults below): vocabulary
256; Zoology's first two cells, (64, 4) and (128, 8), so the pairs grow
with the length; d_model 64 and 128, 2 layers of 2 heads with MLPs of
twice the width, learned positions (as Zoology's attention; rotary ones
refuse linear and hedgehog, whose scores are not dot products); one
learning rate (3e-3, warmed up over 100 steps, constant, then decayed over
the last fifth: wsd); 20,000 training examples, 1,000 test ones, 2,000
steps of 64 at length 64 (about 6 epochs) and 4,000 at 128 (steps grow
with the length, as the plateau below does).

Measured here, a dense model of width 64 (the seeds are config.seed): with
learned positions at (64, 4), seeds 0 and 1 answer 1.0 and 0.9998 at step
2,000 (0.992 and 0.997 at 1,000; 3 minutes each, two at once); at
(128, 8), seed 0 answers 0.26 after 2,000 steps, and in a longer run 0.24,
0.26 and 0.9995 at steps 1,000, 2,000 and 3,000 (4 minutes per 2,000
steps, alone). With rotary positions: at (64, 4), seeds 1 and 2 answer
0.9995 (seed 1 0.9965 already at step 500); at (128, 8), seed 0 0.9995
(0.997 at 1,500) and seed 1 0.18 (7 minutes each); at (64, 8), seed 0
0.9999 and seed 1 0.20; at vocabulary 512 and 2e-3, seed 0 0.15 after
3,000 steps. A seed that fails has learnt which tokens are values, not
which value: recall is learnt suddenly, after a plateau whose length
varies by seed, so a comparison here needs its seeds, and the (128, 8)
cell its 4,000 steps (whether they take dense past 0.99 from every seed is
for its seeds to show).
"""

from configs import default

LENGTH, PAIRS = 64, 4


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
  config.num_train_steps = 2000 * max(1, length // 64)  # See the docstring.
  config.learning_rate = 3e-3
  config.warmup_steps = 100
  config.schedule = 'wsd'
  config.eval_every = 500
  config.checkpoint_every = 500
  config.sample_length = 0

  config.model.family = 'decoder_lm'
  config.model.vocab_size = 256
  config.model.d_model = 64
  config.model.num_heads = 2
  config.model.num_layers = 2
  config.model.mlp_dim = 128
  config.model.position = 'learned'
  config.model.max_len = length
  return config
