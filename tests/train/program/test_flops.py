"""Model FLOPs of a training step, against what XLA counts in the compiled
step."""

import jax
import jax.numpy as jnp
import optax
import pytest

from model import ModelConfig, attention, build
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


def test_matmul_flops_count_dots_scan_steps_and_refuse_loops():
  def count(fn, *shapes):
    return flops.matmul_flops(jax.make_jaxpr(fn)(
        *(jnp.ones(shape) for shape in shapes)).jaxpr)

  assert count(lambda x, w: x @ w, (4, 8), (8, 16)) == 2 * 4 * 8 * 16
  assert count(lambda a, b: jnp.einsum('bij,bjk->bik', a, b), (2, 4, 8),
               (2, 8, 16)) == 2 * 2 * 4 * 8 * 16
  # Inside jit, a scan's body once per step.
  scanned = jax.jit(lambda x, w: jax.lax.scan(
      lambda c, _: (c, c @ w), x, None, length=3)[1])
  assert count(scanned, (4, 8), (8, 8)) == 3 * 2 * 4 * 8 * 8
  looped = lambda x, w: jax.lax.while_loop(
      lambda c: c[1] < 3, lambda c: (c[0] @ w, c[1] + 1), (x, 0))[0]
  assert count(looped, (4, 8), (8, 8)) is None
  # cuDNN's attention, a primitive whose matmuls the jaxpr does not show.
  cudnn = jax.extend.core.Primitive('dot_product_attention_fwd')
  cudnn.def_abstract_eval(lambda x: x)
  assert count(lambda x, w: cudnn.bind(x @ w), (4, 8), (8, 8)) is None
  # Causal linear attention, B 1, 2 heads of 8, 16 positions in one
  # chunk: scores and their sum of values inside the chunk (2 C^2 H
  # each), the chunk's state and the earlier chunks' (none, but computed)
  # read by the queries (2 C H^2 each), and their denominator (2 C H).
  q = jnp.ones((1, 16, 2, 8))
  assert count(lambda q: attention.get('linear')(q, q, q, is_causal=True),
               q.shape) == 2 * (2 * 2 * 16 * 16 * 8 + 2 * 2 * 16 * 8 * 8
                                + 2 * 16 * 8)
