"""The mixture-of-experts feed-forward layer: it reduces to the dense one,
balances by Switch's loss, and drops exactly the tokens past capacity."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, build
from model import moe
from model.layers import Mlp
from tests.helpers.adam_steps import adam_steps
from train.data import tasks
from train.program import steps

B, T, D, M = 2, 8, 16, 32


def config_for(**moe_options) -> ModelConfig:
  return ModelConfig(vocab_size=32, d_model=D, num_heads=2, num_layers=2,
                     mlp_dim=M, max_len=T, moe=moe_options)


def test_one_expert_with_room_for_every_token_is_the_dense_mlp():
  config = config_for(num_experts=1, top_k=1, capacity_factor=1.0)
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  layer = moe.MoeMlp(config)
  params = nn.meta.unbox(layer.init(jax.random.key(1), x)['params'])
  dense = {'wi': {'kernel': params['wi'][0], 'bias': params['wi_bias'][0]},
           'wo': {'kernel': params['wo'][0], 'bias': params['wo_bias'][0]}}
  np.testing.assert_allclose(
      layer.apply({'params': params}, x),
      Mlp(config).apply({'params': dense}, x), atol=1e-5)


@pytest.mark.core
def test_load_balancing_loss_is_one_for_uniform_routing_and_more_when_skewed():
  uniform = jnp.full((B, T, 4), 0.25)
  np.testing.assert_allclose(moe.load_balancing_loss(uniform), 1.0)
  skewed = jax.nn.softmax(jnp.array([3.0, 0.0, 0.0, 0.0]))
  assert moe.load_balancing_loss(jnp.broadcast_to(skewed, (B, T, 4))) > 2.0
  # Every token sure of expert 0: the loss reaches its maximum, E.
  np.testing.assert_allclose(moe.load_balancing_loss(
      jax.nn.one_hot(jnp.zeros((B, T), int), 4)), 4.0)


@pytest.mark.core
def test_tokens_past_capacity_are_dropped_and_counted():
  """All eight tokens of each example choose expert 0 first (and expert 1
  second): with room for 3, each expert keeps tokens 0-2, and 2 * (8 - 3)
  choices per example drop."""
  probs = jnp.broadcast_to(jnp.array([0.6, 0.3, 0.1]), (B, T, 3))
  dispatch, combine, dropped = moe.route(probs, top_k=2, expert_capacity=3)
  np.testing.assert_array_equal(dropped, [10, 10])
  kept = np.asarray(dispatch).sum(-1)  # [B, T, E]
  np.testing.assert_array_equal(kept[0, :, 0], [1, 1, 1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(kept[0, :, 1], [1, 1, 1, 0, 0, 0, 0, 0])
  # Slot c of expert 0 holds token c; top-2 gates renormalised: 2/3, 1/3.
  np.testing.assert_array_equal(np.asarray(dispatch)[0, :3, 0], np.eye(3))
  np.testing.assert_allclose(np.asarray(combine)[0, 0, :2].sum(-1),
                             [2 / 3, 1 / 3], rtol=1e-6)


def test_room_is_taken_in_sequence_order_so_a_decoder_stays_causal():
  """Tokens 0-3 prefer expert 0 then 1, tokens 4-7 expert 1 then 0; with
  room for 4, both experts fill with tokens 0-3, whatever later tokens
  choose; so a decoder whose experts drop tokens stays causal (with every
  first choice placed first, as GShard does, later tokens changed earlier
  logits by up to 1.1 here)."""
  first_half = jnp.array([0.6, 0.3, 0.1])
  probs = jnp.broadcast_to(jnp.concatenate(
      [jnp.tile(first_half, (4, 1)),
       jnp.tile(first_half[jnp.array([1, 0, 2])], (4, 1))]), (B, T, 3))
  dispatch, _, dropped = moe.route(probs, top_k=2, expert_capacity=4)
  kept = np.asarray(dispatch).sum(-1)
  np.testing.assert_array_equal(kept[0, :, 0], [1, 1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(kept[0, :, 1], [1, 1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(dropped, [8, 8])
  # Routing is discrete, so gradients cannot see a leak: change the tokens
  # from p on and compare the logits before p (room for 2 a row: drops).
  model = build(config_for(num_experts=4, top_k=2, every_n_layers=1,
                           capacity_factor=0.5))
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(1, 32, (16, T)))
  variables = jax.jit(model.init)(jax.random.key(0), tokens)
  apply = jax.jit(lambda variables, tokens: model.apply(variables,
                                                        tokens)[0])
  logits = apply(variables, tokens)
  for p in range(1, T):
    later = tokens.at[:, p:].set(jnp.asarray(rng.integers(1, 32, (16, T - p))))
    np.testing.assert_allclose(apply(variables, later)[:, :p],
                               logits[:, :p], atol=1e-6)


def test_groups_are_routed_as_separate_inputs():
  """group_size 4 over 10 tokens: groups 0-3, 4-7 and 8-9 (padded) route
  and drop as three separate inputs would (room for one token an expert
  in each, the last group's capacity that of 4 tokens)."""
  config = config_for(num_experts=4, top_k=2, capacity_factor=0.5,
                      group_size=4)
  whole = dataclasses.replace(config, moe=dataclasses.replace(
      config.moe, group_size=0))
  x = jax.random.normal(jax.random.key(0), (B, 10, D))
  layer = moe.MoeMlp(config)
  params = jax.jit(layer.init)(jax.random.key(1), x)['params']

  def run(layer_config, inputs):
    out, state = jax.jit(lambda inputs: moe.MoeMlp(layer_config).apply(
        {'params': params}, inputs, mutable='moe'))(inputs)
    return out, float(state['moe']['dropped'][0])

  out, dropped = run(config, x)
  parts = [run(whole, x[:, start:stop])
           for start, stop in ((0, 4), (4, 8), (8, 10))]
  np.testing.assert_allclose(
      out, jnp.concatenate([part for part, _ in parts], axis=1), atol=1e-6)
  assert dropped == sum(part_dropped for _, part_dropped in parts) > 0


def test_groups_keep_the_routing_memory_linear_in_the_length():
  """Compiled temporaries of the layer from 128 to 512 tokens: 16x with
  one group an example (dispatch T x C, C ∝ T), 4x with groups of 32."""

  def temporaries(group, length):
    layer = moe.MoeMlp(config_for(num_experts=4, top_k=2, group_size=group))
    x = jnp.zeros((1, length, D))
    params = jax.jit(layer.init)(jax.random.key(0), x)
    compiled = jax.jit(layer.apply).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  whole = [temporaries(0, length) for length in (128, 512)]
  grouped = [temporaries(32, length) for length in (128, 512)]
  assert whole[1] / whole[0] > 10
  assert grouped[1] / grouped[0] < 5
  assert grouped[1] < whole[1] / 4


def test_a_decoder_with_experts_trains_and_reports_its_routing():
  config = config_for(num_experts=4, top_k=2, every_n_layers=2)
  assert [config.has_moe(i) for i in range(2)] == [False, True]
  model = build(config)
  ids = jnp.asarray(np.random.default_rng(0).integers(1, 32, (B, T)))
  batch = {'inputs': ids, 'targets': jnp.roll(ids, -1, axis=1),
           'positions': jnp.tile(jnp.arange(T), (B, 1)),
           'weights': jnp.ones((B, T))}
  params = steps.init_params(model, tasks.LM, jax.random.key(0), T)
  assert params['decoder']['block_1']['moe']['wi'].shape == (4, D, M)
  assert 'mlp' in params['decoder']['block_0']
  _, history = adam_steps(model, tasks.LM, params, batch, 5)
  losses = [float(metrics['loss_sum']) for metrics in history]
  assert losses[-1] < losses[0]
  metrics = history[-1]
  assert 1.0 <= float(metrics['moe_aux_loss_sum'] / metrics['weight_sum']
                      ) <= 4.0
  assert float(metrics['moe_assigned']) == B * T * 2
  assert 0 <= float(metrics['moe_dropped']) <= B * T * 2
