"""Model FLOPs of a training step, against what XLA counts in the compiled
step."""

import jax
import jax.numpy as jnp
import optax
import pytest

from model import ModelConfig, build
from train.data import tasks
from train.program import flops, steps


@pytest.mark.parametrize('family, task', [('decoder_lm', tasks.LM),
                                          ('encoder_decoder', tasks.SEQ2SEQ)])
def test_model_flops_match_the_compiled_step(family, task):
  """The formula counts matmuls; XLA's count of the compiled gradient adds
  the elementwise work (softmax, norms, activations), a few percent."""
  config = ModelConfig(family=family, vocab_size=512, d_model=128,
                       num_heads=4, num_layers=2, mlp_dim=512, max_len=128)
  model, seq_len, batch = build(config), 128, 4
  params = steps.init_params(model, task, jax.random.key(0), seq_len=seq_len)
  tokens = jnp.ones((batch, seq_len), jnp.int32)

  def loss(params):
    args = task.model_args({'inputs': tokens, 'positions': None,
                            'decoder_inputs': tokens})
    logits, _ = model.apply({'params': params}, *args)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens).mean()

  counted = jax.jit(jax.grad(loss)).lower(params).compile().cost_analysis()[
      'flops']
  formula = batch * flops.train_flops_per_example(
      config, task, seq_len, flops.non_embedding_params(params))
  assert 0.85 < formula / counted < 1.05, (formula, counted)


@pytest.mark.core
def test_non_embedding_params_leave_out_the_embedder():
  config = ModelConfig(vocab_size=512, d_model=64, num_heads=4, num_layers=1,
                       mlp_dim=128, position='learned', max_len=32,
                       tie_embeddings=False)
  params = jax.eval_shape(lambda: steps.init_params(
      build(config), tasks.LM, jax.random.key(0), seq_len=32))  # Sizes.
  total = sum(x.size for x in jax.tree.leaves(params))
  embedder = sum(x.size for x in jax.tree.leaves(params['embedder']))
  assert flops.non_embedding_params(params) == total - embedder
  # The token table, the position table and the output projection.
  assert embedder >= 512 * 64 + 32 * 64 + 64 * 512


def test_a_token_goes_through_top_k_of_the_experts():
  config = ModelConfig(vocab_size=64, d_model=16, num_heads=2, num_layers=2,
                       mlp_dim=32, max_len=8,
                       moe={'num_experts': 4, 'top_k': 1})
  params = jax.eval_shape(lambda: steps.init_params(
      build(config), tasks.LM, jax.random.key(0), seq_len=8))  # Sizes.
  moe_layer = params['decoder']['block_1']['moe']
  experts = sum(x.size for name, x in moe_layer.items() if name != 'router')
  all_params = flops.non_embedding_params(params)
  assert flops.non_embedding_params(params, 1 / 4) == all_params - (
      experts * 3 / 4)


def test_peak_of_a_cpu_is_its_measured_matmul_speed():
  assert flops.peak_flops_per_s() == flops.measured_matmul_flops_per_s() > 0
