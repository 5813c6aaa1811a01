"""A language model's text after a prompt ends at its end of sequence: the
padding decoding writes after it is not text (a tokenizer.json may give
id 0, decoding's padding, to a token)."""

import numpy as np
import pytest

from train.decode import decoding, text


class _Letters:
  """Ids 0-25 as 'a'-'z' (so padding, 0, reads 'a'), 26 its boundary."""

  eos_id = 26

  def encode(self, prompt: str) -> np.ndarray:
    return np.asarray([ord(c) - ord('a') for c in prompt], np.int32)

  def decode(self, ids) -> str:
    return ''.join(chr(ord('a') + int(i)) for i in ids if i != self.eos_id)


@pytest.mark.core
def test_a_sample_ends_at_its_end_of_sequence(monkeypatch):
  """Decoding gives 'x', 'y', the end, then padding: the text is the
  prompt and 'xy'."""
  def sample_lm(*args, **kwargs):
    del args, kwargs
    return np.asarray([[23, 24, 26, 0, 0]])

  monkeypatch.setattr(decoding, 'sample_lm', sample_lm)
  dataset = type('Dataset', (), {'tokenizer': _Letters(), 'vocab_size': 27})
  [sample] = text.continue_text(None, None, dataset, 'abc', num_tokens=5,
                                rng=None)
  assert sample == 'abcxy'
