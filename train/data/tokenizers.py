"""Tokenizers: raw bytes, and SentencePiece models trained locally.

Every tokenizer reserves id 0 for padding and id 1 for end of sequence (which
also starts a language-model document).
"""

from collections.abc import Iterable, Iterator
import io

import numpy as np
import sentencepiece as spm

from train.base import storage

PAD_ID = 0
EOS_ID = 1


class ByteTokenizer:
  """UTF-8 bytes as ids: byte b is id b + 2."""

  offset = 2
  vocab_size = 256 + offset

  def encode(self, text: str | bytes) -> np.ndarray:
    data = text.encode('utf-8') if isinstance(text, str) else text
    return np.frombuffer(data, np.uint8).astype(np.int32) + self.offset

  def decode(self, ids: Iterable[int]) -> str:
    """Text of the byte ids; padding and end-of-sequence ids are dropped."""
    ids = np.asarray(list(ids))
    data = (ids[ids >= self.offset] - self.offset).astype(np.uint8).tobytes()
    return data.decode('utf-8', errors='replace')


class SentencePieceTokenizer:
  """A trained SentencePiece model (Kudo & Richardson 2018)."""

  def __init__(self, model_path: str):
    self._processor = spm.SentencePieceProcessor(
        model_proto=storage.path(model_path).read_bytes())
    self.vocab_size = self._processor.get_piece_size()

  def encode(self, text: str | bytes) -> np.ndarray:
    if isinstance(text, bytes):
      text = text.decode('utf-8')
    return np.asarray(self._processor.encode(text), np.int32)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of the ids; padding and end-of-sequence ids are dropped."""
    return self._processor.decode(
        [int(i) for i in ids if int(i) not in (PAD_ID, EOS_ID)])


def train_sentencepiece(texts: Iterable[str], vocab_size: int, model_path: str,
                        *, max_chars: int = 10**7) -> SentencePieceTokenizer:
  """Trains a unigram SentencePiece model on at most `max_chars` of `texts`.

  The model file appears at `model_path` only once it is complete.
  """

  def limited(texts: Iterable[str]) -> Iterator[str]:
    total = 0
    for text in texts:
      total += len(text)
      if total > max_chars:
        return
      yield text

  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=limited(texts), model_writer=model,
      vocab_size=vocab_size, model_type='unigram', character_coverage=1.0,
      pad_id=PAD_ID, eos_id=EOS_ID, unk_id=2, bos_id=-1,
      # A small corpus may hold fewer pieces than asked for.
      hard_vocab_limit=False, minloglevel=2)
  storage.write_whole(storage.path(model_path), model.getvalue())
  return SentencePieceTokenizer(model_path)
