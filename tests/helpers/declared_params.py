"""Models of every family, MoE, the attention variants that own parameters
or make their own projections, and the position schemes, at toy size,
with their parameters as `init` declares them: what the tests of the
declarations (weight decay, hidden matrices) read."""

import jax

from model import ModelConfig, attention, build
from model.config import POSITIONS
from model.positions import SCHEMES
from train.data import tasks
from train.program import steps

TASKS = {'decoder_lm': tasks.LM, 'encoder_decoder': tasks.SEQ2SEQ,
         'rnn_attention': tasks.SEQ2SEQ,
         'encoder_classifier': tasks.CLASSIFICATION}


def small(**overrides) -> ModelConfig:
  return ModelConfig(**dict(
      vocab_size=16, d_model=16, num_heads=2, num_layers=1, mlp_dim=32,
      max_len=8, relative_max_distance=4, relative_buckets=4) | overrides)


CONFIGS = {
    'decoder_lm_untied_layernorm': small(tie_embeddings=False),
    'decoder_lm_value_residual': small(num_layers=2, value_residual=True),
    'decoder_lm_smear_value_embeddings_unet': small(
        num_layers=2, smear=True, value_embeddings=1, unet_skips=True),
    'decoder_lm_moe_swiglu_rmsnorm': small(
        norm='rmsnorm', mlp_activation='swiglu',
        moe=dict(num_experts=2, top_k=1, every_n_layers=1)),
    # value_residual's first block, then one group of a dense block and a
    # block with experts, stacked.
    'decoder_lm_scanned_value_residual_moe': small(
        num_layers=3, scan_layers=True, value_residual=True,
        moe=dict(num_experts=2, top_k=1, every_n_layers=2)),
    'encoder_decoder': small(family='encoder_decoder'),
    'encoder_classifier_cls': small(family='encoder_classifier',
                                    num_classes=3, pooling='cls'),
    'rnn_lstm_additive': small(family='rnn_attention', rnn_cell='lstm',
                               rnn_score='additive'),
    'rnn_gru_general': small(family='rnn_attention', rnn_cell='gru',
                             rnn_score='general'),
} | {f'attention_{name}': small(attention=name) if attention.spec(
    name).causal_only else small(family='encoder_classifier', num_classes=3,
                                 pooling='mean', attention=name)
     for name in attention.names() if attention.spec(name).parameters
     or attention.spec(name).latent_projections} | {
    f'position_{name}': small(position=name, family=(
        'encoder_decoder' if SCHEMES[name].randomized else 'decoder_lm'))
    for name in POSITIONS}


def boxed_params(config: ModelConfig):
  """The parameters' shapes, boxed with their declarations."""
  return jax.eval_shape(
      lambda rng: steps.init_params(build(config), TASKS[config.family], rng,
                                    8, boxed=True), jax.random.key(0))
