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

from model import attention
from model.config import ModelConfig
from model.families.family import Family
from model.families import (decoder_lm, encoder_classifier, encoder_decoder,
                            rnn_attention)
from model.families.decoder_lm import DecoderLM
from model.families.encoder_classifier import EncoderClassifier
from model.families.encoder_decoder import EncoderDecoder
from model.families.rnn_attention import RnnAttention
from model.positions import SCHEMES, rotated_channels

# What a key holds when it is not set.
_DEFAULTS = ModelConfig()

FAMILIES: dict[str, Family] = {family.name: family for family in (
    decoder_lm.FAMILY, encoder_decoder.FAMILY, encoder_classifier.FAMILY,
    rnn_attention.FAMILY)}


def check(config: ModelConfig) -> None:
  """Raises ValueError, naming the key, where `config` combines its family,
  position scheme and attention in a way one of them cannot honour
  (ModelConfig checks each of its values alone)."""
  if config.family not in FAMILIES:
    raise ValueError(f'config.model.family={config.family!r} must be one of '
                     f'{list(FAMILIES)}.')
  family = FAMILIES[config.family]

  def others(trait) -> str:
    return ' or '.join(f'config.model.family={name!r}'
                       for name, f in FAMILIES.items() if trait(f))

  if SCHEMES[config.position].randomized and not family.random_positions:
    raise ValueError(
        f'config.model.position={config.position!r} draws random positions '
        f'in training, which {others(lambda f: f.random_positions)} does, '
        f'not {config.family!r}.')
  if config.moe.num_experts and not family.feed_forward:
    raise ValueError(
        'config.model.moe.num_experts is for the Transformer families; '
        f'config.model.family={config.family!r} has no feed-forward blocks.')
  if config.memory_length and not family.memory:
    raise ValueError(
        f'config.model.memory_length is for {others(lambda f: f.memory)}, '
        f'not {config.family!r}.')
  for name in ('zero_init_outputs', 'value_residual', 'norm_epsilon',
               'embedding_init_stddev', 'scale_tied_readout', 'use_bias',
               'scan_layers'):
    if (getattr(config, name) != getattr(_DEFAULTS, name)
        and not family.feed_forward):
      raise ValueError(
          f'config.model.{name} is for the Transformer families; '
          f'config.model.family={config.family!r} has no Transformer '
          'blocks.')
  for name in ('smear', 'value_embeddings', 'unet_skips'):
    if getattr(config, name) and not family.causal_stack:
      raise ValueError(
          f'config.model.{name} is for '
          f'{others(lambda f: f.causal_stack)}, one causal stack over its '
          f'tokens; not {config.family!r}.')
  if config.attention_sinks and not family.multi_head:
    raise ValueError(
        'config.model.attention_sinks is for '
        f'{others(lambda f: f.multi_head)}, not {config.family!r}, whose '
        'attention has no heads of its own.')
  if config.qk_norm != 'none' and not family.multi_head:
    raise ValueError(
        f'config.model.qk_norm is for {others(lambda f: f.multi_head)}, '
        f'not {config.family!r}, whose attention projects no queries and '
        'keys per head.')
  for index, layer in enumerate(config.layer_configs()):
    entry = (f'config.model.attention[{index}]: '
             if config.num_attentions > 1 else '')
    problem = _attention_problem(layer, family)
    if problem:
      raise ValueError(entry + problem)


def _attention_problem(config: ModelConfig, family: Family) -> str | None:
  """What the one attention of `config` cannot honour in this model of
  `family`, or None."""
  variant = attention.spec(config.attention)
  scheme = SCHEMES[config.position]
  named = f'config.model.attention={config.attention!r}'
  if family.decoder and not variant.causal:
    return (f'{named} cannot be causal, which the decoder of '
            f'config.model.family={config.family!r} needs.')
  if variant.causal_only and not family.causal_stack:
    return (f'{named} is causal only, and config.model.family='
            f'{config.family!r} attends both ways.')
  if config.memory_length and not scheme.relative:
    relative = [name for name, s in SCHEMES.items() if s.relative]
    return (f'config.model.memory_length={config.memory_length} needs a '
            'relative position scheme (config.model.position in '
            f'{relative}), not {config.position!r}.')
  if config.memory_length and not variant.longer_keys:
    return (f'{named} cannot attend to more keys than queries, which '
            'config.model.memory_length needs.')
  if scheme.rotation and not variant.dot_product:
    return (f'config.model.position={config.position!r} makes scores '
            'relative only when they are dot products q . k, which those of '
            f'{named} are not.')
  if config.attention_sinks and not variant.sinks:
    sinking = ', '.join(name for name in attention.names()
                        if attention.spec(name).sinks)
    return (f'config.model.attention_sinks puts a logit in a softmax '
            f'normaliser, which {named} has none of (its weights are no '
            f'softmax over keys); the attentions that take it: {sinking}.')
  if scheme.bias and not variant.bias:
    return (f'config.model.position={config.position!r} adds a bias to the '
            f'logits, which {named} cannot take.')
  if variant.latent_projections:
    return _latent_problem(config, named)
  return None


def _latent_problem(config: ModelConfig, named: str) -> str | None:
  """What an attention that projects from a latent (`named`) cannot
  honour in `config`, or None: its decoding never forms a key or value."""
  if not config.attention_projections:
    return (f'{named} makes its queries, keys and values from a latent; '
            'config.model.attention_projections=False wants none.')
  for key, on in (('qk_norm', config.qk_norm != 'none'),
                  ('value_residual', config.value_residual),
                  ('value_embeddings', config.value_embeddings)):
    if on:
      return (f'config.model.{key} changes keys or values, which {named} '
              'never forms while decoding (it attends over their latent).')
  if rotated_channels(config) >= config.head_dim:
    return (f'{named} takes its rope part from the channels rope rotates, '
            f'and config.model.rope_fraction={config.rope_fraction} leaves '
            'its latent none; give a fraction below 1 (DeepSeek-V2 rotates '
            '1/3 of a head).')
  return None


def build(config: ModelConfig) -> nn.Module:
  """The model of family `config.family`, checked against it."""
  check(config)
  return FAMILIES[config.family].module(config)


def trainers(task: str) -> list[str]:
  """The families that train on `task` (a train/data/tasks.py name)."""
  return [name for name, family in FAMILIES.items() if task in family.tasks]


__all__ = ['FAMILIES', 'Family', 'build', 'check', 'trainers', 'DecoderLM',
           'EncoderDecoder', 'EncoderClassifier', 'RnnAttention']
