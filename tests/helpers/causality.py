"""A check shared by the model tests: a language model is causal."""

import jax
import numpy as np


def assert_causal(model, tokens_BxT, positions=None, params=None) -> None:
  """For each t in `positions` (default: all): the logits at t and before
  are bitwise the same whatever the tokens after t, and those at t change
  with the token at t, under `params` (default: the model's initial
  ones). One compiled forward pass serves every t; each token changed
  becomes another of [1, V), never padding."""
  length = tokens_BxT.shape[1]
  vocab = model.config.vocab_size
  tokens_BxT = np.asarray(tokens_BxT)
  if params is None:
    params = jax.jit(model.init)(jax.random.key(0), tokens_BxT)['params']
  logits = jax.jit(lambda tokens: model.apply(
      {'params': params}, tokens)[0])
  want = np.asarray(logits(tokens_BxT))
  shifts = np.random.default_rng(0).integers(1, vocab - 1, tokens_BxT.shape)
  others = (tokens_BxT - 1 + shifts) % (vocab - 1) + 1  # Each one changed.
  for t in range(length) if positions is None else positions:
    later = np.where(np.arange(length) > t, others, tokens_BxT)
    np.testing.assert_array_equal(np.asarray(logits(later))[:, :t + 1],
                                  want[:, :t + 1])
    here = np.where(np.arange(length) == t, others, tokens_BxT)
    assert np.abs(np.asarray(logits(here))[:, t] - want[:, t]).sum(
        -1).min() > 0
