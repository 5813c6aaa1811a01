"""Tokenizers: raw bytes, SentencePiece models trained locally, and
Hugging Face's tokenizer.json files (an imported model's own).

Bytes and SentencePiece reserve id 0 for padding and id 1 for end of
sequence, which also starts a language-model document. A tokenizer.json
keeps its own ids: its document boundary (`eos_id`) is its own special
token, and nothing reads id 0 as padding in a language model's rows (their
segment ids and weights say where padding is).
"""

from collections.abc import Iterable, Iterator
import io
from typing import Any

import json

import numpy as np
import sentencepiece as spm
import tokenizers as hf_tokenizers

from train.base import storage
from train.base.errors import InputError

PAD_ID = 0
EOS_ID = 1


class _OwnIds:
  """A tokenizer of ours: its documents, and so a prompt, start with the
  end-of-sequence id."""

  eos_id = EOS_ID

  def encode_prompt(self, text: str) -> np.ndarray:
    """`text` as the model reads a prompt: after the id that starts a
    document."""
    return np.concatenate([[self.eos_id], self.encode(text)]).astype(np.int32)


class ByteTokenizer(_OwnIds):
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


class SentencePieceTokenizer(_OwnIds):
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


# Beside a tokenizer.json, transformers' file naming its special tokens.
HF_CONFIG = 'tokenizer_config.json'
HF_TOKENIZER = 'tokenizer.json'


class HfTokenizer:
  """A Hugging Face fast tokenizer (`tokenizer.json`, read with the
  `tokenizers` package: GPT-2's byte-level BPE, Llama 3's, ...), its ids as
  they are. Its document boundary is the `bos_token` of the
  tokenizer_config.json beside it (else its `eos_token`; GPT-2 names one
  token both), or else its only special token; `key` names the config key
  that gave `path` in a refusal."""

  def __init__(self, path: str, key: str = 'config.tokenizer'):
    self.path = path
    try:
      self._tokenizer = hf_tokenizers.Tokenizer.from_str(
          storage.path(path).read_text())
    except Exception as error:  # The package's errors have several types.
      raise ValueError(f'{key}={path!r} is not a readable tokenizer.json: '
                       f'{str(error).splitlines()[0][:200]}') from None
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._boundary(key)

  def _boundary(self, key: str) -> int:
    config = storage.path(self.path).parent / HF_CONFIG
    named = json.loads(config.read_text()) if config.exists() else {}
    for field in ('bos_token', 'eos_token'):
      token = named.get(field)
      if isinstance(token, dict):  # {'content': ..., ...} in some versions.
        token = token.get('content')
      if token is not None and self._tokenizer.token_to_id(token) is not None:
        return self._tokenizer.token_to_id(token)
    special = [token_id for token_id, token in
               self._tokenizer.get_added_tokens_decoder().items()
               if token.special]
    if len(special) != 1:
      raise ValueError(
          f'{key}={self.path!r}: which token starts a document? Its '
          f'{HF_CONFIG} names no bos_token or eos_token, and it has '
          f'{len(special)} special tokens, not one.')
    return special[0]

  def encode(self, text: str | bytes) -> np.ndarray:
    if isinstance(text, bytes):  # A file's bytes: what is not UTF-8 as U+FFFD.
      text = text.decode('utf-8', errors='replace')
    return np.asarray(self._tokenizer.encode(
        text, add_special_tokens=False).ids, np.int32)

  def encode_prompt(self, text: str) -> np.ndarray:
    """`text` as the model's own tokenizer makes a prompt: its
    post-processor's special tokens added (Llama's BOS; GPT-2's none),
    and a special token's text (<|endoftext|>) read as that token."""
    return np.asarray(self._tokenizer.encode(text).ids, np.int32)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of the ids; special tokens (the document boundary) dropped."""
    return self._tokenizer.decode([int(i) for i in ids],
                                  skip_special_tokens=True)


def hf_tokenizer_file(location: str) -> str:
  """The tokenizer.json that `location` names: the file, or a directory
  holding one (an import's workdir)."""
  path = storage.path(location)
  return str(path / HF_TOKENIZER) if path.is_dir() else location


def hf_files(location: str, key: str = 'config.tokenizer') -> dict[str, Any]:
  """{name: its path (storage.path)} of the tokenizer.json that `location`
  names and of the tokenizer_config.json beside it, where there is one;
  InputError naming `key` where there is no tokenizer.json."""
  path = storage.path(hf_tokenizer_file(location))
  if not path.is_file():
    raise InputError(f'{key}={location!r}: there is no tokenizer.json '
                     f'there ({path}).')
  beside = path.parent / HF_CONFIG
  return {HF_TOKENIZER: path} | (
      {HF_CONFIG: beside} if beside.is_file() else {})


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
