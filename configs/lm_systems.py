r"""The byte LM of configs/lm_stdlib.py:baseline with one of the attention
systems of the course notes, trained for the same 550 steps so the results
compare:

  python -m train.train --config=configs/lm_systems.py:system=alternating \
      --workdir=workdirs/lm_alternating

Systems:
  alternating        dense and locally banded (window 32) layers in turn, as
                     GPT-3 does (Brown et al. 2020).
  memory_compressed  local (window 32) and memory-compressed (width and
                     stride 3) layers in turn, the Transformer-DMCA of Liu
                     et al. (2018); one window a row, since memory
                     compression takes key padding masks only.
  parameter_free     self-attention with no projections (y_i = sum_j
                     softmax_j(x_i . x_j) x_j); the MLPs keep theirs.
  deberta            disentangled attention positions (He et al. 2021)
                     instead of sinusoidal ones.
  moe                the feed-forward layer of every second block a mixture
                     of 4 experts, top-2 routing, capacity factor 1.25
                     (Shazeer et al. 2017); logs moe_aux_loss and
                     moe_dropped_fraction.

Results: docs/configs.md, `lm_systems.py`.
"""

from configs import default, lm_stdlib

SYSTEMS = ('alternating', 'memory_compressed', 'parameter_free', 'deberta',
           'moe')


def get_config(arg: str = 'system=alternating'):
  """`arg` is `system=<name>`, one of SYSTEMS."""
  system = default.choice(arg, 'system', SYSTEMS, 'configs/lm_systems.py')
  config = lm_stdlib.get_config('baseline')
  model = config.model
  if system in ('alternating', 'memory_compressed'):
    config.sample_length = 0  # Local layers cannot read a key/value cache.
  if system == 'alternating':
    model.attention = 'dense,local'
    model.attention_options.local.window = 32
  elif system == 'memory_compressed':
    model.attention = 'local,memory_compressed'
    model.attention_options.local.window = 32
    model.attention_options.memory_compressed.update(width=3, stride=3)
    config.pack_sequences = False
  elif system == 'parameter_free':
    model.attention_projections = False
  elif system == 'deberta':
    model.position = 'deberta'
    model.relative_max_distance = 64
  else:
    model.moe.update(num_experts=4, top_k=2, capacity_factor=1.25,
                     every_n_layers=2)
  return config
