"""A language model's text after a prompt: the tokenizer around
decoding.sample_lm, for `python -m train.generate` and a run's closing
sample."""

import functools

import flax.linen as nn
import jax
import numpy as np

from train.base.errors import InputError
from train.data import datasets, tokenizers
from train.decode import decoding


def continue_text(model: nn.Module, params, dataset: datasets.Dataset,
                  prompt: str, *, num_tokens: int, rng: jax.Array,
                  num_samples: int = 1, max_positions: int | None = None,
                  **choice) -> list[str]:
  """`num_samples` texts: `prompt` (after the end-of-sequence id that
  starts a document) and up to `num_tokens` tokens after it, fewer where
  the positions would reach `max_positions`, ending at the end of a
  document; `choice`: temperature, top_k, top_p (decoding.choose)."""
  tokenizer = dataset.tokenizer
  prompt_ids = np.concatenate([[tokenizers.EOS_ID],
                               tokenizer.encode(prompt)]).astype(np.int32)
  if max_positions is not None:
    num_tokens = min(num_tokens, max_positions - len(prompt_ids))
    if num_tokens < 1:
      raise InputError(f'the prompt is {len(prompt_ids)} tokens; the model '
                       f'reads positions below {max_positions}.')
  sample = jax.jit(functools.partial(
      decoding.sample_lm, model, num_tokens=num_tokens,
      eos_id=tokenizers.EOS_ID, vocab_size=dataset.vocab_size, **choice))
  tokens = sample(params, np.tile(prompt_ids, (num_samples, 1)),
                  np.full(num_samples, len(prompt_ids)), rng=rng)
  return [tokenizer.decode(np.concatenate([prompt_ids, row]))
          for row in np.asarray(tokens)]
