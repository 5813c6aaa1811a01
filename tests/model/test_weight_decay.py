"""Weight decay reaches every weight of every model, and no bias or
normalisation scale."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import weight_decay
from model.matrices import hidden_matrices, is_entry
from tests.helpers.declared_params import CONFIGS, boxed_params
from train.base.train_config import TrainConfig
from train.data import tasks
from train.program import mesh, optim
from train.run.program import compile_program


def role(path) -> str:
  """What a parameter is, read from the name Flax's layers and ours give
  it: the reference the declarations are checked against."""
  name = path[-1].key
  if name == 'bias' or name.endswith('_bias'):
    return 'bias'
  # Gains: a norm's (latent attention's norms' too, kv_gain and q_gain),
  # value residual's mix of values, the gates of value embeddings and
  # smear, U-net skips' weights, and a recurrence's log decay rates
  # (Mamba's A).
  if name.endswith('_gain'):
    return 'scale'
  return 'scale' if name in ('scale', 'value_mix', 'value_embedding_gate',
                             'gain', 'unet_weights', 'a_log') else 'weight'


@pytest.mark.parametrize('name', CONFIGS)
def test_every_weight_is_decayed_and_no_bias_or_scale(name):
  mask = weight_decay.decay_mask(boxed_params(CONFIGS[name]))
  roles = set()
  for path, decayed in jax.tree_util.tree_leaves_with_path(mask):
    roles.add(role(path))
    assert decayed == (role(path) == 'weight'), jax.tree_util.keystr(path)
  assert {'weight', 'bias'} <= roles


@pytest.mark.core
@pytest.mark.parametrize('name', ['adamw', 'muon'])
def test_the_optimizer_decays_what_the_mask_marks(name):
  """With zero gradients, the update is -rate * decay * parameter on the
  weights, at Muon's rate on its matrices (decoupled weight decay scaled
  by each one's learning rate, as AdamW's), and zero on the biases and
  scales."""
  config = CONFIGS['decoder_lm_moe_swiglu_rmsnorm']
  boxed = boxed_params(config)
  params = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype),
                        nn.meta.unbox(boxed))
  train_config = TrainConfig(optimizer=name, learning_rate=0.1,
                             muon_learning_rate=0.2, warmup_steps=0,
                             weight_decay=0.5, schedule='constant')
  optimizer, _ = optim.make_optimizer(train_config, boxed)
  updates = jax.jit(lambda params: optimizer.update(
      jax.tree.map(jnp.zeros_like, params), optimizer.init(params),
      params)[0])(params)
  matrices = jax.tree.leaves(hidden_matrices(boxed), is_leaf=is_entry)
  for (path, update), decayed, matrix in zip(
      jax.tree_util.tree_leaves_with_path(updates),
      jax.tree.leaves(weight_decay.decay_mask(boxed)), matrices):
    rate = 0.2 if name == 'muon' and matrix is not None else 0.1
    np.testing.assert_allclose(update, -rate * 0.5 if decayed else 0.0,
                               rtol=1e-6, err_msg=jax.tree_util.keystr(path))
  assert any(matrices)


def test_a_training_program_decays_by_its_models_declarations(monkeypatch):
  declared = []
  make_optimizer = optim.make_optimizer
  monkeypatch.setattr(optim, 'make_optimizer', lambda config, boxed: (
      declared.append(boxed), make_optimizer(config, boxed))[1])
  config = CONFIGS['decoder_lm_moe_swiglu_rmsnorm']
  train_config = TrainConfig(seq_len=8, batch_size=2, model=config)
  compile_program(train_config, tasks.LM, mesh.make_mesh(
      train_config.parallelism, jax.devices()[:1]))
  [boxed] = declared
  mask = weight_decay.decay_mask(boxed)
  assert mask == weight_decay.decay_mask(boxed_params(config))
  assert set(jax.tree.leaves(mask)) == {True, False}
