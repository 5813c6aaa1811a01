"""A language model's text after a prompt: the tokenizer around
decoding.sample_lm, for `python -m train.generate` and a run's closing
sample."""

import functools

import flax.linen as nn
import jax
import numpy as np

from train.base.errors import InputError
from train.data import datasets
from train.decode import decoding


def continue_text(model: nn.Module, params, dataset: datasets.Dataset,
                  prompt: str, *, num_tokens: int, rng: jax.Array,
                  num_samples: int = 1, max_positions: int | None = None,
                  prompt_key: str = 'config.sample_prompt',
                  **choice) -> list[str]:
  """`num_samples` texts: `prompt` (encoded as the tokenizer makes a
  prompt, tokenizers.*.encode_prompt) and up to `num_tokens` tokens after
  it, fewer where the positions would reach `max_positions`, ending at the
  end of a document; `choice`: temperature, top_k, top_p
  (decoding.choose). InputError naming `prompt_key`, what gave the
  prompt, where no token fits after it."""
  tokenizer = dataset.tokenizer
  prompt_ids = tokenizer.encode_prompt(prompt)
  if max_positions is not None:
    num_tokens = min(num_tokens, max_positions - len(prompt_ids))
    if num_tokens < 1:
      raise InputError(
          f'{prompt_key} is {len(prompt_ids)} tokens; the model reads '
          f'positions below {max_positions}, so a prompt of at most '
          f'{max_positions - 1} leaves room for a token after it.')
  sample = jax.jit(functools.partial(
      decoding.sample_lm, model, num_tokens=num_tokens,
      eos_id=tokenizer.eos_id, vocab_size=dataset.vocab_size, **choice))
  tokens = sample(params, np.tile(prompt_ids, (num_samples, 1)),
                  np.full(num_samples, len(prompt_ids)), rng=rng)
  # A row holds padding after its end of sequence: cut there.
  return [tokenizer.decode(np.concatenate(
      [prompt_ids, _ended(row, tokenizer.eos_id)]))
          for row in np.asarray(tokens)]


def _ended(row: np.ndarray, eos_id: int) -> np.ndarray:
  """`row` up to its first `eos_id`, excluded."""
  ends = np.flatnonzero(row == eos_id)
  return row[:ends[0]] if ends.size else row
