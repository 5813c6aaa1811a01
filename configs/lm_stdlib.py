r"""Byte-level DecoderLM on the Python standard library (`make train`).

  python -m train.train --config=configs/lm_stdlib.py --workdir=workdirs/lm_stdlib
  python -m train.train --config=configs/lm_stdlib.py:round2 \
      --workdir=workdirs/lm_stdlib_round2
  python -m experiments.sweep --config=configs/lm_stdlib.py:round2 \
      --workdir=workdirs/lm_speedrun3 --set=eval_every=250

A first look in under a minute (dataset built; 20 evaluation batches, not
the whole split; the warmup and the wsd cooldown overlap, with a warning):

  make train WORKDIR=/tmp/smoke \
      ARGS='--config.num_train_steps=20 --config.num_eval_steps=20'

The default is the best configuration three searches found among those
that train in 10 minutes on 2 CPU cores, evaluations and closing sample
included: the baseline with the overrides of ROUND_ONE (shape, positions,
schedule; experiments/results/lm_speedrun/), ROUND_TWO (Muon, QK-norm,
output projections starting at zero; experiments/results/lm_speedrun2/)
and ROUND_THREE (windows by layer, smear, value residuals, the soft cap,
cautious weight decay; get_sweep(), experiments/results/lm_speedrun3/).
A new default must be a record of `python -m experiments.speedrun`
(experiments/results/speedrun/: ROUND_THREE is row 2, against the second
search's winner in row 1).

Results: docs/configs.md, `lm_stdlib.py`.
"""

from configs import default
from configs import search

# Shapes of the search, each with the steps it trains in about 480 s on 2
# CPU cores (training steps measured at 1.05 a second for d128 at batch
# 32, 2.15 at batch 16, 0.67 for d192, 1.03 for d256 at batch 16), leaving
# room for compilation, two evaluations and the sample. SwiGLU takes two
# thirds of the MLP width, which keeps its parameters and FLOPs those of
# GELU's.
SHAPES = {
    # name: (d_model, num_heads, num_layers, mlp_dim, batch_size, steps)
    'd128-b32': (128, 4, 4, 512, 32, 500),
    'd128-b16': (128, 4, 4, 512, 16, 1000),
    'd192-b32': (192, 6, 4, 768, 32, 320),
    'd256-b16': (256, 4, 4, 1024, 16, 500),
}


def _preset(shape: str, activation: str) -> dict:
  d_model, heads, layers, mlp_dim, batch_size, steps = SHAPES[shape]
  return {'model.d_model': d_model, 'model.num_heads': heads,
          'model.num_layers': layers, 'model.mlp_activation': activation,
          'model.mlp_dim': mlp_dim if activation != 'swiglu'
                           else mlp_dim * 2 // 3 // 8 * 8,
          'batch_size': batch_size, 'num_train_steps': steps,
          'eval_every': steps // 2, 'checkpoint_every': steps // 2}


# The best trial of the first search (trial-002;
# experiments/results/lm_speedrun/), as overrides of the baseline: its shape
# preset and the values drawn beside it.
ROUND_ONE = _preset('d128-b16', 'gelu') | {
    'learning_rate': 3.3e-3, 'warmup_steps': 50, 'schedule': 'wsd',
    'weight_decay': 0.1, 'model.position': 'alibi',
    'model.norm': 'layernorm', 'model.tie_embeddings': False,
}
# The best trial of the second search (trial-003;
# experiments/results/lm_speedrun2/), as overrides of ROUND_ONE: Muon on the
# hidden matrices, QK-norm, output projections starting at zero.
ROUND_TWO = {
    'optimizer': 'muon', 'muon_learning_rate': 0.017,
    'learning_rate': 5.4e-3, 'model.qk_norm': 'rmsnorm',
    'model.zero_init_outputs': True,
}
# The best trial of the third search (trial-008;
# experiments/results/lm_speedrun3/), as overrides of ROUND_TWO: local
# windows alternating by layer between the whole row and 64 tokens, the
# one-token smear, value residuals, the soft cap, cautious weight decay.
ROUND_THREE = {
    'muon_learning_rate': 0.0126, 'cautious_weight_decay': True,
    'model.attention': 'local,local',
    'model.attention_options.local.window': (256, 64),
    'model.smear': True, 'model.value_residual': True,
    'model.logit_softcap': 30.0,
}
ARGS = ('', 'round2', 'round1', 'baseline')
# The speedrun's track: the corpus its records were measured on, Python
# 3.11.7's standard library (train/data/stdlib.py's corpus_sha256). A run
# on another Python's library says that it is off the track.
TRACK_CORPUS = (
    '5764bb67f6efd23308c39f5922fd2e0da5381d5aeafe3a9696c100956a3d220f')

# The training techniques the second search drew, each one key: its value
# off and on (value_residual joined after it); configs/lm_ablation.py
# turns each one alone to the other value from `:round2`.
OPTIONS = {
    'optimizer': ('adamw', 'muon'),
    'model.qk_norm': ('none', 'rmsnorm'),
    'model.mlp_activation': ('gelu', 'relu2'),
    'model.zero_init_outputs': (False, True),
    'z_loss': (0.0, 1e-4),
    'model.logit_softcap': (0.0, 30.0),
    'model.value_residual': (False, True),
}


def get_config(arg: str = ''):
  """`arg` is '' (the third search's winner), 'round2' (the second
  search's, the default before the third), 'round1' (the first search's)
  or 'baseline' (the default before the first)."""
  if arg not in ARGS:
    raise ValueError(
        f'configs/lm_stdlib.py takes one of {ARGS}, got {arg!r}.')
  config = default.get_config()
  config.dataset = 'python_stdlib_bytes'
  config.track_corpus = TRACK_CORPUS
  config.seq_len = 256
  config.batch_size = 32
  config.num_train_steps = 550
  config.learning_rate = 3e-3
  config.warmup_steps = 50
  config.eval_every = 275
  config.checkpoint_every = 275
  config.sample_length = 300
  config.sample_prompt = 'def '

  config.model.family = 'decoder_lm'
  config.model.vocab_size = 258  # 256 bytes, padding and end of sequence.
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.num_layers = 4
  config.model.mlp_dim = 512
  config.model.max_len = config.seq_len
  if arg != 'baseline':
    config.update_from_flattened_dict(ROUND_ONE)
    # Chunked attention, on the backend's fused kernel where one computes
    # the case; 1.22 times dense's steps on 2 CPU cores.
    config.model.attention = 'auto'
  if arg in ('', 'round2'):
    config.update_from_flattened_dict(ROUND_TWO)
  if arg == '':
    config.update_from_flattened_dict(ROUND_THREE)
  return config


# The third search's options, each one key off and on: the architecture and
# optimizer changes of today's GPT-2 speedrun records, and the round-two
# options its ablation found better (value residuals, the soft cap).
RECORD_OPTIONS = {
    'optimizer': ('muon', 'normuon'),
    'cautious_weight_decay': (False, True),
    'model.value_embeddings': (0, 1),
    'model.unet_skips': (False, True),
    'model.smear': (False, True),
    'model.value_residual': (False, True),
    'model.logit_softcap': (0.0, 30.0),
}
# Attention windows by layer: `:round2`'s full causal attention, or
# local windows alternating long (the whole row) and short by layer, the
# long ones constant or growing over the first 600 steps.
WINDOWS = {
    'full': {'model.attention': 'auto'},
    'long-short': {'model.attention': 'local,local',
                   'model.attention_options.local.window': '256,64'},
    'long-short-growing': {'model.attention': 'local,local',
                           'model.attention_options.local.window': '256,64',
                           'window_schedule': '((300, 64), (600, 128))'},
}


def get_sweep():
  """The speedrun's third search, from `:round2` (the default it searched
  from; its shape and 1000 steps kept): RECORD_OPTIONS, the attention
  WINDOWS and Muon's learning rate, ranked by validation bits per byte.
  The first two searches' spaces are in their leaderboards
  (experiments/results/lm_speedrun/ and lm_speedrun2/)."""
  return search.Space(
      {'muon_learning_rate': search.log_uniform(0.01, 0.04),
       'windows': search.presets(WINDOWS)}
      | {key: search.choice(list(values))
         for key, values in RECORD_OPTIONS.items()},
      trials=12, metric='eval_bits_per_byte', mode='min', startup_trials=4)
