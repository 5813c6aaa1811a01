"""A check shared by the model tests: a language model is causal."""

import jax
import jax.numpy as jnp
import numpy as np


def assert_causal(model, tokens_BxT, positions=None) -> None:
  """d(logits at t)/d(embeddings at s) is exactly zero for every s > t, and
  not zero at t itself, for each t in `positions` (default: all)."""
  batch, length = tokens_BxT.shape
  variables = jax.jit(model.init)(jax.random.key(0), tokens_BxT)
  cotangent = jax.random.normal(jax.random.key(1),
                                (batch, length, model.config.vocab_size))

  @jax.jit
  def embedding_grads(t):
    def loss(perturbations):
      logits, _ = model.apply({'params': variables['params'],
                            'perturbations': perturbations}, tokens_BxT)
      return jnp.sum(logits[:, t] * cotangent[:, t])
    return jax.grad(loss)(variables['perturbations'])['embeddings']

  for t in range(length) if positions is None else positions:
    grads_BxTxD = np.asarray(embedding_grads(t))
    np.testing.assert_array_equal(grads_BxTxD[:, t + 1:], 0.0)
    assert np.abs(grads_BxTxD[:, t]).sum(-1).min() > 0
