"""Model families by name. Each module here holds one family's model and
its `FAMILY` (model/families/family.py: what it trains on and what the
code around it asks of it); adding a family is one module and its line in
FAMILIES.

  decoder_lm          DecoderLM, a causal language model
  encoder_decoder     EncoderDecoder, the Transformer of Vaswani et al.
  encoder_classifier  EncoderClassifier, an encoder and a classifier head
  rnn_attention       RnnAttention, the RNN encoder-decoder with attention

Inputs are int token ids [B, T] with 0 as padding. A model's forward call
(`__call__`; an EncoderDecoder's `decode`) returns (output, state): logits (float32 whatever config.dtype is) or their
Readout, and a model.state Cache or Memory, or None. The sequence-to-
sequence families decode through two methods: `start_decoding(inputs_BxS,
length) -> (source, state)` and `decoding_step(source, inputs_BxS,
tokens_BxT, positions_BxT, state) -> (logits, state)`, `source` being what
every beam of a source reads unchanged.
"""

import flax.linen as nn

from model.config import ModelConfig
from model.families.family import Family
from model.families import (decoder_lm, encoder_classifier, encoder_decoder,
                            rnn_attention)
from model.families.decoder_lm import DecoderLM
from model.families.encoder_classifier import EncoderClassifier
from model.families.encoder_decoder import EncoderDecoder
from model.families.rnn_attention import RnnAttention

FAMILIES: dict[str, Family] = {family.name: family for family in (
    decoder_lm.FAMILY, encoder_decoder.FAMILY, encoder_classifier.FAMILY,
    rnn_attention.FAMILY)}


def build(config: ModelConfig) -> nn.Module:
  """The model of family `config.family`."""
  return FAMILIES[config.family].module(config)


def trainers(task: str) -> list[str]:
  """The families that train on `task` (a train/tasks.py name)."""
  return [name for name, family in FAMILIES.items() if task in family.tasks]


__all__ = ['FAMILIES', 'Family', 'build', 'trainers', 'DecoderLM',
           'EncoderDecoder', 'EncoderClassifier', 'RnnAttention']
