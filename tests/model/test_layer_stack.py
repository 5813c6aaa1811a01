"""config.model.scan_layers: each family computes what its unscanned twin
computes from the same parameters (converted by model/layer_stack.py),
forward and backward; the conversion is exact both ways."""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, build, layer_stack
from model.state import Memory

B, T, V = 2, 8, 32


def tiny(**overrides) -> ModelConfig:
  return ModelConfig(**dict(
      vocab_size=V, d_model=16, num_heads=2, num_layers=2, mlp_dim=32,
      max_len=16) | overrides)


def tokens(seed: int) -> jax.Array:
  ids = np.random.default_rng(seed).integers(1, V, (B, T))
  ids[1, -2:] = 0  # Padding at the end of one example.
  return jnp.asarray(ids)


CASES = {
    # value_residual's first block, then a loop over the other two.
    'decoder_lm_value_residual_remat': dict(num_layers=3, value_residual=True,
                                            remat='full'),
    # Two groups of two blocks: dense then local, experts in the second.
    'decoder_lm_pattern_experts': dict(
        num_layers=4, attention='dense,local', position='rope',
        attention_options={'local': {'window': 3}},
        moe={'num_experts': 2, 'every_n_layers': 2}),
    'encoder_decoder': dict(family='encoder_decoder', position='relative',
                            relative_max_distance=4),
    'encoder_classifier': dict(family='encoder_classifier', num_layers=3,
                               remat='dots_saveable'),
    # Smear mixes the embeddings before the loop.
    'decoder_lm_smear': dict(smear=True),
}
# Transformer-XL's memory, read and written by each block in the loop.
TWINS = CASES | {'transformer_xl': dict(
    num_layers=3, position='relative', memory_length=4,
    relative_max_distance=4)}


def inputs(config: ModelConfig) -> tuple:
  if config.family == 'encoder_decoder':
    return tokens(0), tokens(1)
  return (tokens(0),)


@functools.cache
def twins(name: str):
  """(unscanned model, its parameters, scanned model, those converted) of
  a case."""
  plain = tiny(**TWINS[name])
  scanned = dataclasses.replace(plain, scan_layers=True)
  model, scanned_model = build(plain), build(scanned)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0),
                                             *inputs(plain))
                         ['params'])
  shapes = jax.eval_shape(lambda: nn.meta.unbox(scanned_model.init(
      jax.random.key(0), *inputs(plain))['params']))
  converted = layer_stack.relayout(params, shapes)
  assert jax.tree.structure(converted) == jax.tree.structure(shapes)
  return model, params, scanned_model, converted


@pytest.mark.parametrize('name', CASES)
def test_a_scanned_stack_computes_what_its_blocks_one_by_one_do(name):
  model, params, scanned_model, converted = twins(name)
  args = inputs(model.config)
  experts = bool(model.config.moe.num_experts)

  def loss_and_grads(model, params):
    def loss(params):
      out = model.apply({'params': params}, *args,
                        mutable=['moe'] if experts else False)
      (logits, _), sown = out if experts else (out, {})
      return jnp.mean(logits ** 2), sown
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (want, want_sown), want_grads = loss_and_grads(model, params)
  (got, got_sown), got_grads = loss_and_grads(scanned_model, converted)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  chex.assert_trees_all_close(layer_stack.relayout(got_grads, want_grads),
                              want_grads, rtol=1e-5, atol=1e-7)
  if experts:  # The layers' statistics, stacked, are the same numbers.
    chex.assert_trees_all_close(
        layer_stack.unstacked(got_sown, group=2, start=0), want_sown,
        rtol=1e-6)


def test_a_scanned_transformer_xl_carries_the_same_memory():
  model, params, scanned_model, converted = twins('transformer_xl')
  memory = Memory.empty(model.config, B)
  for seed in (0, 1):  # The second segment reads the first's memory.
    want, want_memory = jax.jit(model.apply)({'params': params},
                                             tokens(seed), memory=memory)
    got, got_memory = jax.jit(scanned_model.apply)(
        {'params': converted}, tokens(seed), memory=memory)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_memory.hidden, want_memory.hidden,
                               rtol=1e-5, atol=1e-6)
    memory = want_memory


def test_the_layouts_convert_into_each_other_exactly():
  _, params, _, converted = twins('decoder_lm_pattern_experts')
  assert layer_stack.layout(params) is None
  assert layer_stack.layout(converted) == (2, 0)  # Groups of 2 blocks.
  decoder = converted['decoder']
  assert set(decoder) == {'layers', 'final_norm'}
  # layers/block_j[g] is block 2 g + j: experts in blocks 1 and 3.
  np.testing.assert_array_equal(decoder['layers']['block_1']['moe']['wi'][1],
                                params['decoder']['block_3']['moe']['wi'])
  np.testing.assert_array_equal(
      decoder['layers']['block_0']['mlp']['wi']['kernel'][1],
      params['decoder']['block_2']['mlp']['wi']['kernel'])
  back = layer_stack.relayout(converted, params)
  chex.assert_trees_all_equal(back, params)
  # value_residual's first block stays apart, before groups of one.
  _, params, _, converted = twins('decoder_lm_value_residual_remat')
  assert layer_stack.layout(converted) == (1, 1)
  np.testing.assert_array_equal(
      converted['decoder']['block_0']['mlp']['wi']['kernel'],
      params['decoder']['block_0']['mlp']['wi']['kernel'])


def test_stacked_parameters_carry_the_layers_axis_name():
  model = build(tiny(scan_layers=True, num_layers=3))
  boxed = model.init(jax.random.key(0), tokens(0))['params']
  kernel = boxed['decoder']['layers']['block_0']['mlp']['wi']['kernel']
  assert kernel.names == ('layers', 'embed', 'mlp')
  assert kernel.value.shape == (3, 16, 32)

