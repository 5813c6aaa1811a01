"""Weight decay reaches every weight of every model, and no bias or
normalisation scale."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, attention, build, weight_decay
from model.config import POSITIONS
from model.positions import SCHEMES
from train.base.train_config import TrainConfig
from train.data import tasks
from train.program import mesh, optim, steps
from train.run.program import compile_program

TASKS = {'decoder_lm': tasks.LM, 'encoder_decoder': tasks.SEQ2SEQ,
         'rnn_attention': tasks.SEQ2SEQ,
         'encoder_classifier': tasks.CLASSIFICATION}


def small(**overrides) -> ModelConfig:
  return ModelConfig(**dict(
      vocab_size=16, d_model=16, num_heads=2, num_layers=1, mlp_dim=32,
      max_len=8, relative_max_distance=4, relative_buckets=4) | overrides)


CONFIGS = {
    'decoder_lm_untied_layernorm': small(tie_embeddings=False),
    'decoder_lm_moe_swiglu_rmsnorm': small(
        norm='rmsnorm', mlp_activation='swiglu',
        moe=dict(num_experts=2, top_k=1, every_n_layers=1)),
    'encoder_decoder': small(family='encoder_decoder'),
    'encoder_classifier_cls': small(family='encoder_classifier',
                                    num_classes=3, pooling='cls'),
    'rnn_lstm_additive': small(family='rnn_attention', rnn_cell='lstm',
                               rnn_score='additive'),
    'rnn_gru_general': small(family='rnn_attention', rnn_cell='gru',
                             rnn_score='general'),
} | {f'attention_{name}': small(family='encoder_classifier', num_classes=3,
                                pooling='mean',
                                attention=name) for name in attention.names()
                                if attention.spec(name).parameters} | {
    f'position_{name}': small(position=name, family=(
        'encoder_decoder' if SCHEMES[name].randomized else 'decoder_lm'))
    for name in POSITIONS}


def role(path) -> str:
  """What a parameter is, read from the name Flax's layers and ours give
  it: the reference the declarations are checked against."""
  name = path[-1].key
  if name == 'bias' or name.endswith('_bias'):
    return 'bias'
  return 'scale' if name == 'scale' else 'weight'


def boxed_params(config: ModelConfig):
  return jax.eval_shape(
      lambda rng: steps.init_params(build(config), TASKS[config.family], rng,
                                    8, boxed=True), jax.random.key(0))


@pytest.mark.parametrize('name', CONFIGS)
def test_every_weight_is_decayed_and_no_bias_or_scale(name):
  mask = weight_decay.decay_mask(boxed_params(CONFIGS[name]))
  roles = set()
  for path, decayed in jax.tree_util.tree_leaves_with_path(mask):
    roles.add(role(path))
    assert decayed == (role(path) == 'weight'), jax.tree_util.keystr(path)
  assert {'weight', 'bias'} <= roles


@pytest.mark.core
def test_the_optimizer_decays_what_the_mask_marks():
  """With zero gradients, AdamW's update is -lr * decay * parameter on the
  weights and zero on the biases and scales."""
  config = CONFIGS['decoder_lm_moe_swiglu_rmsnorm']
  boxed = boxed_params(config)
  params = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype),
                        nn.meta.unbox(boxed))
  train_config = TrainConfig(learning_rate=0.1, warmup_steps=0,
                             weight_decay=0.5, schedule='constant')
  optimizer, _ = optim.make_optimizer(train_config,
                                      weight_decay.decay_mask(boxed))
  updates = jax.jit(lambda params: optimizer.update(
      jax.tree.map(jnp.zeros_like, params), optimizer.init(params),
      params)[0])(params)
  for (path, update), decayed in zip(
      jax.tree_util.tree_leaves_with_path(updates),
      jax.tree.leaves(weight_decay.decay_mask(boxed))):
    np.testing.assert_allclose(update, -0.05 if decayed else 0.0, rtol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


def test_a_training_program_decays_by_its_models_declarations(monkeypatch):
  masks = []
  make_optimizer = optim.make_optimizer
  monkeypatch.setattr(optim, 'make_optimizer', lambda config, mask: (
      masks.append(mask), make_optimizer(config, mask))[1])
  config = CONFIGS['decoder_lm_moe_swiglu_rmsnorm']
  train_config = TrainConfig(seq_len=8, batch_size=2, model=config)
  compile_program(train_config, tasks.LM, mesh.make_mesh(
      train_config.parallelism, jax.devices()[:1]))
  [mask] = masks
  assert mask == weight_decay.decay_mask(boxed_params(config))
  assert set(jax.tree.leaves(mask)) == {True, False}
