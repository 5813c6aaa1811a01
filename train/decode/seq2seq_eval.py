"""Evaluation of an encoder-decoder by what it writes: the inputs of a split
decoded by beam search (greedy at beam size 1), scored against the
references. Shared by `python -m train.translate` and the evaluations
during training (config.decode_splits).
"""

from collections.abc import Callable
import dataclasses
import json
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import tqdm

from model import ModelConfig
from model.positions import SCHEMES
from train.base import storage
from train.base.errors import InputError
from train.data import datasets, tokenizers
from train.decode import decoding, scores


def until_eos(ids) -> list[int]:
  """The ids up to and including the first EOS (all of them if none)."""
  ids = [int(i) for i in ids]
  return ids[:ids.index(tokenizers.EOS_ID) + 1] if (
      tokenizers.EOS_ID in ids) else ids


@dataclasses.dataclass(frozen=True)
class DecodeSet:
  """The first examples of a split: sources to decode, references to score
  against."""

  split: str
  sources: list[np.ndarray]
  references: list[list[int]]

  @property
  def source_len(self) -> int:
    return max(len(source) for source in self.sources)


def take(dataset: datasets.Dataset, split: str, count: int) -> DecodeSet:
  """The first `count` examples of `split` (all of them for -1)."""
  examples = dataset.splits[split]
  count = len(examples) if count == -1 else min(count, len(examples))
  return DecodeSet(split, [np.asarray(examples[i]['inputs'])
                           for i in range(count)],
                   [until_eos(examples[i]['targets']) for i in range(count)])


def output_length(model_config: ModelConfig, source_len: int,
                  max_length: int, *, names: str) -> int:
  """Tokens to decode: `max_length`, or with 0 one and a half times the
  source and 10 more; fewer where the position scheme ends (a learned
  table; the decoder reads a start token, then its outputs). `names` says
  which setting asked for these sources, for the error of a source longer
  than the scheme's positions."""
  num_tokens = max_length or int(1.5 * source_len) + 10
  limit = SCHEMES[model_config.position].max_positions(model_config)
  if limit is None:
    return num_tokens
  if source_len > limit:
    raise InputError(f'{names} has inputs of {source_len} tokens, more than '
                     f'the {limit} {model_config.position} positions of the '
                     'model.')
  return min(num_tokens, limit - 1)


def beam_decoder(model: nn.Module, vocab_size: int, *, beam_size: int,
                 alpha: float, num_tokens: int, out_sharding=None
                 ) -> Callable[[Any, jax.Array], jax.Array]:
  """Jitted `(params, inputs_BxS) -> tokens [B, num_tokens]`: each source's
  best hypothesis (PAD_ID after its EOS), laid out as `out_sharding`
  says."""
  def decode(params, inputs_BxS):
    batch = inputs_BxS.shape[0]
    step, cache = decoding.seq2seq_step(model, params, inputs_BxS,
                                        1 + num_tokens, vocab_size)
    tokens_BxKxN, _ = decoding.beam_search(
        step, cache, np.zeros((batch, 1), np.int32), np.ones(batch, np.int32),
        beam_size=beam_size, num_tokens=num_tokens,
        eos_id=tokenizers.EOS_ID, alpha=alpha)
    return tokens_BxKxN[:, 0]
  return jax.jit(decode, out_shardings=out_sharding)


def decode(decoder: Callable, params, decode_set: DecodeSet, *,
           batch_size: int, place: Callable = lambda batch: batch,
           progress: bool = False) -> list[list[int]]:
  """Each source's hypothesis up to its EOS, `batch_size` sources a call
  (the last batch padded with empty rows); `place` lays a host batch out
  on the devices. `progress`: a progress bar (on the first host)."""
  hypotheses = []
  sources = decode_set.sources
  for start in tqdm.trange(
      0, len(sources), batch_size, desc=f'decoding {decode_set.split}',
      unit='batch', leave=False,
      disable=not progress or jax.process_index() != 0):
    batch = np.zeros((batch_size, decode_set.source_len), np.int32)
    rows = sources[start:start + batch_size]
    for row, source in enumerate(rows):
      batch[row, :len(source)] = source
    outputs = np.asarray(decoder(params, place(batch)))
    hypotheses += [until_eos(row) for row in outputs[:len(rows)]]
  return hypotheses


def write_decoded(path: str, decode_set: DecodeSet,
                  hypotheses: list[list[int]]) -> None:
  """One JSON line per example, {"inputs", "hypothesis", "reference"} (ids),
  written whole (train/base/storage.py)."""
  storage.write_whole(storage.path(path), ''.join(
      json.dumps({'inputs': [int(i) for i in source],
                  'hypothesis': hypothesis, 'reference': reference}) + '\n'
      for source, hypothesis, reference in zip(
          decode_set.sources, hypotheses, decode_set.references)))


def read_decoded(path: str) -> list[dict[str, list[int]]]:
  """The examples write_decoded wrote."""
  return [json.loads(line)
          for line in storage.path(path).read_text().splitlines()]


def as_text(dataset: datasets.Dataset) -> Callable[[list[int]], str]:
  """Ids as a line of text: detokenised for text datasets, the ids
  otherwise."""
  if dataset.tokenizer is not None:
    return dataset.tokenizer.decode
  return lambda ids: ' '.join(str(i) for i in ids)


def score(dataset: datasets.Dataset, hypotheses: list[list[int]],
          references: list[list[int]]) -> dict[str, float]:
  """exact_match, token_accuracy and, for text datasets, bleu."""
  result = {'exact_match': scores.exact_match(hypotheses, references),
            'token_accuracy': scores.token_accuracy(hypotheses, references)}
  if dataset.tokenizer is not None:
    text = as_text(dataset)
    result['bleu'] = scores.bleu([text(h) for h in hypotheses],
                                 [text(r) for r in references])
  return result
