"""A language model's text after a prompt ends at its end of sequence: the
padding decoding writes after it is not text (a tokenizer.json may give
id 0, decoding's padding, to a token); a prompt with no room after it is
refused by what gave it."""

import re

import numpy as np
import pytest

from train.base.errors import InputError
from train.decode import decoding, text


class _Letters:
  """Ids 0-25 as 'a'-'z' (so padding, 0, reads 'a'), 26 its boundary."""

  eos_id = 26

  def encode(self, prompt: str) -> np.ndarray:
    return np.asarray([ord(c) - ord('a') for c in prompt], np.int32)

  def encode_prompt(self, prompt: str) -> np.ndarray:
    return np.concatenate([[self.eos_id], self.encode(prompt)])

  def decode(self, ids) -> str:
    return ''.join(chr(ord('a') + int(i)) for i in ids if i != self.eos_id)


_DATASET = type('Dataset', (), {'tokenizer': _Letters(), 'vocab_size': 27})


@pytest.mark.core
def test_a_sample_ends_at_its_end_of_sequence(monkeypatch):
  """Decoding gives 'x', 'y', the end, then padding: the text is the
  prompt and 'xy'."""
  def sample_lm(*args, **kwargs):
    del args, kwargs
    return np.asarray([[23, 24, 26, 0, 0]])

  monkeypatch.setattr(decoding, 'sample_lm', sample_lm)
  [sample] = text.continue_text(None, None, _DATASET, 'abc', num_tokens=5,
                                rng=None)
  assert sample == 'abcxy'


@pytest.mark.core
def test_a_prompt_that_leaves_no_position_is_refused_by_its_flag():
  """'abc' after the boundary is 4 tokens: positions below 4 leave no
  room for a token after it, and the refusal names what gave it."""
  with pytest.raises(InputError, match=re.escape(
      '--prompt is 4 tokens; the model reads positions below 4, so a '
      'prompt of at most 3 leaves room for a token after it.')):
    text.continue_text(None, None, _DATASET, 'abc', num_tokens=5, rng=None,
                       max_positions=4, prompt_key='--prompt')
