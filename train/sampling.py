"""Sampling text from a DecoderLM by recomputing the whole prefix per token.

Simple and exact for short samples: each new token costs one forward pass
over a fixed [1, max_len] buffer, whose causal mask makes the positions not
yet written irrelevant.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def sample(model: nn.Module, params, prompt: np.ndarray, *, num_tokens: int,
           max_len: int, temperature: float, rng: jax.Array) -> np.ndarray:
  """`prompt` followed by up to `num_tokens` sampled ids, within `max_len`.

  Temperature 0 is greedy decoding.
  """
  end = min(len(prompt) + num_tokens, max_len)
  buffer = np.zeros((1, max_len), np.int32)
  buffer[0, :len(prompt)] = prompt

  @jax.jit
  def generate(params, buffer, rng):
    def body(position, carry):
      buffer, rng = carry
      rng, step_rng = jax.random.split(rng)
      logits_V = model.apply({'params': params}, buffer)[0, position - 1]
      if temperature == 0.0:
        token = jnp.argmax(logits_V)
      else:
        token = jax.random.categorical(step_rng, logits_V / temperature)
      return buffer.at[0, position].set(token), rng

    return jax.lax.fori_loop(len(prompt), end, body, (buffer, rng))[0]

  return np.asarray(generate(params, buffer, rng))[0, :end]
