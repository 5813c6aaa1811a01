"""The cross-entropy of vocabulary logits, whole and a block at a time,
against optax on float32 logits; and three matmuls over the vocabulary in
a train step, none of them float32 in a bfloat16 one."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model import ModelConfig, build
from model.readout import Readout
from train.data import tasks
from train.program import cross_entropy, steps

# A vocabulary of no round size, so that no block of anything divides it.
VOCAB = 37


def _reference_sum(logits_BxTxV, targets_BxT, weights_BxT, smoothing,
                   z_loss=0.0):
  """optax's weighted cross-entropy of float32 logits, plus z_loss times
  each token's squared log-sum-exp."""
  labels = optax.smooth_labels(jax.nn.one_hot(targets_BxT, VOCAB), smoothing)
  losses = optax.softmax_cross_entropy(logits_BxTxV, labels) + z_loss * (
      jax.scipy.special.logsumexp(logits_BxTxV, axis=-1) ** 2)
  return jnp.sum(losses * weights_BxT)


@pytest.mark.core
def test_token_losses_match_optax():
  logits = jax.random.normal(jax.random.key(0), (3, 5))
  targets = jnp.array([0, 3, 4])
  losses = cross_entropy.token_losses(logits, targets, 0.2)
  np.testing.assert_allclose(losses.loss, optax.softmax_cross_entropy(
      logits, optax.smooth_labels(jax.nn.one_hot(targets, 5), 0.2)),
                             rtol=1e-6)
  np.testing.assert_allclose(
      losses.nll,
      optax.softmax_cross_entropy_with_integer_labels(logits, targets),
      rtol=1e-6)
  np.testing.assert_array_equal(losses.correct,
                                jnp.argmax(logits, -1) == targets)


@pytest.mark.parametrize('smoothing,z_loss,cap', [
    (0.0, 0.0, 0.0), (0.1, 0.0, 0.0),
    # A z-loss and a tanh cap of the logits (which reach about 10 here).
    (0.1, 0.05, 3.0)])
def test_blockwise_loss_and_gradients_equal_optax(monkeypatch, smoothing,
                                                  z_loss, cap):
  batch, length, width = 2, 12, 8
  keys = jax.random.split(jax.random.key(1), 4)
  hidden = jax.random.normal(keys[0], (batch, length, width))
  kernel = jax.random.normal(keys[1], (width, VOCAB))
  bias = jax.random.normal(keys[2], (VOCAB,))
  targets = jax.random.randint(keys[3], (batch, length), 0, VOCAB)
  weights = jnp.ones((batch, length)).at[1, 7:].set(0.0)  # Padding.
  # Blocks of 2 positions: 6 blocks, their gradients summed by the scan.
  monkeypatch.setattr(cross_entropy, 'MAX_BLOCK_LOGITS',
                      batch * 2 * VOCAB)
  assert cross_entropy.num_blocks(batch, length, VOCAB) == 6

  def blockwise(hidden, kernel, bias, weights=weights):
    return cross_entropy.readout_loss_sum(
        Readout(hidden, kernel, bias, divisor=2.0, cap=cap), targets,
        weights, smoothing, z_loss)

  def reference(hidden, kernel, bias, weights):
    logits = jnp.einsum('btd,dv->btv', hidden, kernel,
                        precision='highest') / 2.0 + bias
    if cap:
      logits = cap * jnp.tanh(logits / cap)
    return _reference_sum(logits, targets, weights, smoothing, z_loss)

  # The token weights' gradient too: each token's loss.
  (value, losses), grads = jax.jit(jax.value_and_grad(
      blockwise, argnums=(0, 1, 2, 3), has_aux=True))(hidden, kernel, bias,
                                                       weights)
  expected, expected_grads = jax.jit(jax.value_and_grad(
      reference, argnums=(0, 1, 2, 3)))(hidden, kernel, bias, weights)
  np.testing.assert_allclose(value, expected, rtol=1e-5)
  chex.assert_trees_all_close(grads, expected_grads, rtol=1e-4, atol=1e-5)
  logits = Readout(hidden, kernel, bias, divisor=2.0, cap=cap).logits()
  if cap:  # The cap binds: raw logits pass it, capped ones stay under.
    raw = Readout(hidden, kernel, bias, divisor=2.0).logits()
    assert jnp.abs(logits).max() < cap < jnp.abs(raw).max()
  np.testing.assert_array_equal(losses.correct,
                                jnp.argmax(logits, -1) == targets)
  # Without differentiation: the same values (the pass that takes no
  # gradient), and the per-token losses are optax's.
  undifferentiated, plain_losses = jax.jit(blockwise)(hidden, kernel, bias)
  np.testing.assert_allclose(undifferentiated, value, rtol=1e-6)
  labels = optax.smooth_labels(jax.nn.one_hot(targets, VOCAB), smoothing)
  np.testing.assert_allclose(
      plain_losses.loss, optax.softmax_cross_entropy(logits, labels)
      + z_loss * jax.scipy.special.logsumexp(logits, axis=-1) ** 2,
      rtol=1e-5)
  # A scaled loss scales the gradient: the backward pass multiplies the
  # forward's gradient by the cotangent.
  scaled = jax.grad(lambda kernel: -3.0 * blockwise(hidden, kernel, bias)[0])
  np.testing.assert_allclose(scaled(kernel), -3.0 * expected_grads[1],
                             rtol=1e-4, atol=1e-5)


def test_bfloat16_readout_is_float32_to_bfloat16_precision():
  # Embedding-shaped weights [V, D]; bfloat16 operands, float32 sums.
  keys = jax.random.split(jax.random.key(2), 3)
  hidden = jax.random.normal(keys[0], (2, 6, 16))
  embedding = jax.random.normal(keys[1], (VOCAB, 16)) / 4
  targets = jax.random.randint(keys[2], (2, 6), 0, VOCAB)

  def loss(hidden, embedding, dtype):
    readout = Readout(hidden.astype(dtype), embedding, weights_spec='vd',
                      compute_dtype=dtype)
    return cross_entropy.readout_loss_sum(readout, targets,
                                          jnp.ones(targets.shape))[0]

  grad = jax.value_and_grad(loss, argnums=(0, 1))
  value, (d_hidden, d_embedding) = grad(hidden, embedding, jnp.bfloat16)
  expected, (expected_hidden, expected_embedding) = grad(
      hidden, embedding, jnp.float32)
  assert d_embedding.dtype == jnp.float32  # As the parameter is.
  np.testing.assert_allclose(value, expected, rtol=1e-2)
  for grad, expected_grad in ((d_hidden, expected_hidden),
                              (d_embedding, expected_embedding)):
    np.testing.assert_allclose(grad.astype(jnp.float32), expected_grad,
                               rtol=0.05, atol=0.02)


def _matmuls_over(jaxpr, size: int) -> list[set]:
  """The operand dtypes of each dot_general in `jaxpr` (and the jaxprs
  inside it) with an operand that has a dimension of `size`."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general' and any(
        size in var.aval.shape for var in eqn.invars):
      found.append({var.aval.dtype for var in eqn.invars})
    for param in eqn.params.values():
      for inner in param if isinstance(param, (tuple, list)) else [param]:
        inner = getattr(inner, 'jaxpr', inner)
        if isinstance(inner, jax.extend.core.Jaxpr):
          found += _matmuls_over(inner, size)
  return found


@pytest.mark.parametrize('tie_embeddings', [True, False])
def test_bfloat16_train_step_runs_three_bfloat16_matmuls_over_the_vocabulary(
    monkeypatch, tie_embeddings):
  """The logits, and the two gradient matmuls taken with them: no
  recomputation in the backward pass, and no float32 operand; also under a
  z-loss and a tanh cap of the logits."""
  # Two blocks of positions: the gradients are taken inside the scan.
  monkeypatch.setattr(cross_entropy, 'MAX_BLOCK_LOGITS', 2 * 4 * VOCAB)
  config = ModelConfig(vocab_size=VOCAB, d_model=16, num_heads=2,
                       num_layers=1, mlp_dim=32, max_len=8,
                       tie_embeddings=tie_embeddings, dtype='bfloat16',
                       logit_softcap=30.0)
  optimizer = optax.adamw(1e-3)
  row = jnp.ones((2, 8), jnp.int32)
  batch = {'inputs': row, 'targets': row, 'weights': row.astype(float),
           'positions': jnp.broadcast_to(jnp.arange(8), (2, 8))}

  def vocabulary_matmuls(config):
    model = build(config)
    params = steps.init_params(model, tasks.LM, jax.random.key(0), 8)
    state = steps.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                             opt_state=optimizer.init(params))
    return _matmuls_over(jax.make_jaxpr(
        lambda state, batch: steps.train_step(
            state, batch, jax.random.key(0), model=model, task=tasks.LM,
            optimizer=optimizer, learning_rates={}, z_loss=1e-4))(
                state, batch).jaxpr, VOCAB)

  assert vocabulary_matmuls(config) == [{jnp.dtype(jnp.bfloat16)}] * 3
  # The check sees float32 operands where the step computes in float32.
  assert vocabulary_matmuls(dataclasses.replace(config, dtype='float32')) == [
      {jnp.dtype(jnp.float32)}] * 3
