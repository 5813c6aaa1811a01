"""ModelConfig: the hyperparameters of every model family, validated.

Configs under `configs/` hold these keys in `config.model`; `ModelConfig.
from_mapping(config.model)` turns them into this frozen (hashable) dataclass,
so a typo or an inconsistent size is reported, naming the key, before
anything is traced or compiled.
"""

from collections.abc import Mapping
import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from model import attention
from model.activations import ACTIVATIONS
from model.attention import options as variant_options
from model.positions import SCHEMES

# The token id of padding, in every family.
PAD_ID = 0
RNN_CELLS = ('lstm', 'gru')
RNN_SCORES = ('additive', 'general')
NORMS = ('layernorm', 'rmsnorm')
NORM_POSITIONS = ('pre', 'post')
# Position schemes (model/positions.py says what each does).
POSITIONS = tuple(SCHEMES)
POOLINGS = ('cls', 'mean')
DTYPES = ('float32', 'bfloat16', 'float16')
# What a block keeps for the backward pass: everything (none), only its
# input (full: the rest is recomputed), or the matmul outputs
# (dots_saveable: elementwise work is recomputed).
REMAT_POLICIES = ('none', 'full', 'dots_saveable')


def _set_options(options: Mapping[str, Any]) -> dict[str, Any]:
  """The attention options given a value: those config.model leaves unset
  (None, the attention's default: configs/default.py), and the groups
  under an attention's name with none set, are left out."""
  kept = {}
  for key, value in options.items():
    if isinstance(value, Mapping):
      value = _set_options(value)
    if value not in (None, {}):
      kept[key] = value
  return kept


def occurrence_values(value: Any) -> tuple | None:
  """The values of an option given one per occurrence of its attention in
  the pattern: a tuple or list, or a string of them separated by commas
  (the command line's form, '1024,128'); None for a single value. So
  are the entries of a pattern of attentions ('local,dense')."""
  if isinstance(value, (tuple, list)):
    return tuple(value)
  if isinstance(value, str) and ',' in value:
    return tuple(part.strip() for part in value.split(','))
  return None


def _typed(value: Any, kind: type | None) -> Any:
  """`value` as an option of type `kind` (None: unknown, taken as it is),
  a string read as the number it spells; ValueError where it is not one."""
  if kind is None:
    return value
  if isinstance(value, str) and kind in (int, float):
    value = kind(value)
  accepted = (int, float) if kind is float else kind
  if not isinstance(value, accepted) or (
      isinstance(value, bool) and kind is not bool):
    raise ValueError(value)
  return value


def resolved(name: str, *, dropout: bool) -> str:
  """The attention `name` stands for: 'auto' the fastest exact one (with
  attention `dropout` or without), any other itself."""
  return attention.fastest_exact(dropout=dropout) if name == 'auto' else name


def option_fits(pattern: Any, key: str, value: Any, *,
                dropout: bool = False) -> bool:
  """Whether `value` set for the attention option `key` (`window`, or
  `local.window` under an attention's name) is one that
  config.model.attention=`pattern` reads: under the name of an entry,
  one value or one per occurrence of it; flat, an option of the one
  attention (`auto` resolved as `resolved` does)."""
  names = occurrence_values(pattern) or (pattern,)
  name, _, option = key.rpartition('.')
  if not name and len(names) == 1:
    one = resolved(names[0], dropout=dropout)
    if one in attention.names() and option in variant_options.option_names(
        one):
      name = names[0]
  values = occurrence_values(value)
  count = names.count(name)
  return count > 0 and (values is None or len(values) == count)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """`config.model.moe`: mixture-of-experts feed-forward layers (Shazeer et
  al. 2017), routed as Switch (Fedus et al. 2022) and GShard (Lepikhin et
  al. 2021) do."""

  # Experts per MoE layer; 0 keeps every feed-forward layer dense.
  num_experts: int = 0
  # Experts each token is sent to (1: Switch; 2: GShard, gates renormalised
  # over the two).
  top_k: int = 2
  # An expert takes at most capacity_factor * G * top_k / num_experts tokens
  # of a group of G tokens (see group_size); tokens past that are dropped
  # (the residual carries them) and counted.
  capacity_factor: float = 1.25
  # Every n-th block (the last of each n) has the MoE layer.
  every_n_layers: int = 2
  # Consecutive tokens of an example routed together, capacity counted per
  # group (GShard's groups): the dispatch tensors hold T * E * capacity
  # entries an example, so a fixed group keeps them linear in T. 0: the
  # whole example is one group.
  group_size: int = 0
  # Weight of the load-balancing loss (Switch's num_experts * sum_e f_e P_e,
  # 1 when routing is uniform) added to the training loss.
  aux_loss_weight: float = 0.01

  def check(self, fail) -> None:
    """Fails, naming the key, on a value that cannot work."""
    for name in ('num_experts', 'top_k', 'every_n_layers', 'group_size'):
      value = getattr(self, name)
      least = 0 if name in ('num_experts', 'group_size') else 1
      if isinstance(value, bool) or not isinstance(value, int) or (
          value < least):
        fail(f'config.model.moe.{name}={value!r} must be an integer >= '
             f'{least}.')
    if self.num_experts and self.top_k > min(self.num_experts, 2):
      fail(f'config.model.moe.top_k={self.top_k} must be 1 or 2, and at '
           f'most config.model.moe.num_experts={self.num_experts}.')
    for name in ('capacity_factor', 'aux_loss_weight'):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or value < 0 or (
          name == 'capacity_factor' and value <= 0):
        fail(f'config.model.moe.{name}={value!r} must be a number '
             f'{"> 0" if name == "capacity_factor" else ">= 0"}.')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Model hyperparameters. Token id 0 is padding in every family."""

  # Which model: decoder_lm (GPT-2), encoder_decoder (Vaswani et al. 2017),
  # encoder_classifier (an encoder with a pooled classification head), or
  # rnn_attention (Bahdanau et al. 2015: a bidirectional RNN encoder and an
  # attending RNN decoder, no Transformer blocks). See model/families/.
  family: str = 'decoder_lm'
  # Number of token ids, padding (0) included.
  vocab_size: int = 256
  # Width of the residual stream (the embedding size).
  d_model: int = 128
  # Query heads per attention layer.
  num_heads: int = 4
  # Key/value heads: num_heads for multi-head, a divisor of it for
  # grouped-query, 1 for multi-query attention. None means num_heads.
  num_kv_heads: int | None = None
  # Width of each head. None means d_model // num_heads.
  head_dim: int | None = None
  # Transformer blocks; encoder_decoder has this many in each of its stacks.
  num_layers: int = 2
  # Hidden width of the feed-forward layer.
  mlp_dim: int = 512
  # Feed-forward nonlinearity: relu, relu2 (relu squared; So et al. 2021),
  # gelu, or swiglu (Shazeer 2020).
  mlp_activation: str = 'gelu'
  # Normalisation layer: layernorm or rmsnorm (Zhang & Sennrich 2019).
  norm: str = 'layernorm'
  # Added to the variance in every normalisation layer (QK-norm's too):
  # flax's 1e-6 by default; GPT-2 uses 1e-5, Llama 1e-5 or 1e-6.
  norm_epsilon: float = 1e-6
  # Whether the projections that write to the residual stream (attention's
  # output, the MLP's and each expert's second layer) start at zero, so
  # that a pre-norm block with attention projections starts as the
  # identity (modded-nanogpt's records). Transformer families only.
  zero_init_outputs: bool = False
  # Value residual learning (Zhou et al. 2024; the modded-nanogpt records):
  # self-attention in each layer of a stack after its first attends with
  # a * v + b * v_first, v_first the first layer's values and a, b learned
  # per layer (both 0.5 at first). Transformer families with attention
  # projections only; a stack of one layer has nothing to mix.
  value_residual: bool = False
  # Value embeddings (the modded-nanogpt records): this many extra token
  # embedding tables of the values' width (num_kv_heads x head_dim); table
  # i's row of each token, times a learned gate per layer (0.5 at first),
  # is added to the values of layer i and of layer num_layers - n + i.
  # decoder_lm only, 2n <= num_layers; not under scan_layers (the layers
  # differ) nor with a memory (its tokens are gone). 0: off.
  value_embeddings: int = 0
  # U-net skip connections (the modded-nanogpt records): the output of
  # each block i of the first half, times a learned weight (1 at first),
  # is added to the input of block num_layers - 1 - i. decoder_lm only;
  # not under scan_layers nor with a memory.
  unet_skips: bool = False
  # Smear (the modded-nanogpt records): each token's embedding plus its
  # predecessor's (in its own document) times a learned gate,
  # lambda * sigmoid(w . x[:12]), lambda and w zero at first (the identity).
  # Causal. decoder_lm only; not with a memory.
  smear: bool = False
  # A tanh cap on the output logits, cap * tanh(logits / cap) (Gemma 2;
  # the modded-nanogpt records): a positive number, or 0 for none.
  logit_softcap: float = 0.0
  # QK-norm: each head's queries and keys normalised (layernorm or rmsnorm,
  # a scale per head dim) after their projections and before any rotation
  # by position or feature map, so that q . k stays bounded (Dehghani et
  # al. 2023; Wortsman et al. 2023); kernelised attention reads them
  # normalised too. none: off.
  qk_norm: str = 'none'
  # pre: x + f(norm(x)) with a final norm (GPT-2); post: norm(x + f(x))
  # (Vaswani et al. 2017).
  norm_position: str = 'pre'
  # Position information: none; absolute, added to the embeddings:
  # sinusoidal (Vaswani et al. 2017), learned, or random_sinusoidal
  # (sinusoidal of positions drawn from [0, max_len) in training, Ruoss et
  # al. 2023; encoder_decoder only); or relative, in
  # self-attention: relative (Shaw et al. 2018, learned per clipped
  # distance), t5_bias (Raffel et al. 2020, learned per distance bucket),
  # rope (Su et al. 2021, rotated queries and keys), alibi (Press et al.
  # 2022, a fixed linear penalty on distance) or deberta (He et al. 2021,
  # disentangled attention: content-to-position and position-to-content
  # terms beside q . k, over distances clipped to +-relative_max_distance,
  # all scaled by 1 / sqrt(3 head_dim)).
  position: str = 'sinusoidal'
  # Longest sequence (in tokens) the model reads: the learned position
  # table's size, random_sinusoidal's range, and Linformer's projected
  # length.
  max_len: int = 512
  # relative, deberta: distances are clipped to +-this; t5_bias: distances
  # beyond it share the last bucket.
  relative_max_distance: int = 128
  # t5_bias: buckets of distance (half exact, half logarithmic).
  relative_buckets: int = 32
  # rope: the longest wavelength of the rotation frequencies.
  rope_max_wavelength: float = 10_000.0
  # rope: the fraction of each head's channels that rotate (the first
  # rope_fraction * head_dim, an even number; GPT-NeoX's rotary_pct); the
  # others carry no position.
  rope_fraction: float = 1.0
  # Dropout on the embeddings and on every sublayer's output.
  dropout_rate: float = 0.0
  # Dropout on the attention weights.
  attention_dropout_rate: float = 0.0
  # Self-attention function, by its name in model.attention.names(), or
  # auto: the fastest exact one for the backend (model.attention.
  # fastest_exact); or several, separated by commas (or a tuple), cycled
  # over the layers: 'dense,local' alternates dense and locally banded
  # layers as GPT-3 does. Cross-attention is always dense.
  attention: str | tuple[str, ...] = 'dense'
  # Self-attention with learned query/key/value/output projections (True),
  # or parameter-free (False): y_i = sum_j softmax_j(x_i . x_j) x_j, one
  # head over the whole width, logits unscaled (self-attention's first form,
  # before projections). Cross-attention keeps its projections.
  attention_projections: bool = True
  # Attention sinks: a learned logit per query head (0 at first) in each
  # self-attention row's softmax normaliser, a key of value zero that lets
  # a row attend to nothing (Xiao et al. 2024; GPT-OSS). The variants
  # whose weights are a softmax over keys take it (model.attention.spec(
  # name).sinks), on XLA and the general fused kernels (not cuDNN's).
  attention_sinks: bool = False
  # Options of that function (e.g. window for local, rank for linformer;
  # kernel for chunked and local: auto, xla, cudnn, pallas_tpu or
  # pallas_gpu, see model/attention/kernels/fused.py), as (name, value)
  # pairs, or a dict: {'window': 64}. Options may also be keyed by the
  # attention's name, {'local': {'window': 64}}, which is how several
  # attentions take theirs (held as one tuple of pairs per entry). An
  # attention the pattern names m times takes an option as one value or m,
  # the k-th occurrence the k-th: 'local,local' with
  # {'local': {'window': (1024, 128)}}.
  attention_options: tuple = ()
  # Output projection shares the token embedding matrix (Press & Wolf 2017).
  tie_embeddings: bool = True
  # Standard deviation of the token embeddings at initialisation: 1 (unit
  # variance, which scale_tied_readout suits) or, as GPT-2's, 0.02.
  embedding_init_stddev: float = 1.0
  # A tied output projection divides the logits by sqrt(d_model), keeping
  # those of unit-variance embeddings of order one; False reads out x E^T
  # as GPT-2 does.
  scale_tied_readout: bool = True
  # Biases in the attention projections, the MLP's (and experts') layers
  # and an untied output projection: GPT-2 has them, Llama none.
  use_bias: bool = True
  # encoder_classifier only: number of classes of the head.
  num_classes: int = 2
  # encoder_classifier only: cls (a learned token prepended to the input)
  # or mean (average over non-padding positions).
  pooling: str = 'cls'
  # Dtype of the computation (activations); logits and loss stay float32.
  dtype: str = 'float32'
  # Dtype in which parameters are stored.
  param_dtype: str = 'float32'
  # Activations each block recomputes in the backward pass rather than
  # keeping (memory for time): none, full or dots_saveable (see
  # REMAT_POLICIES). Under scan_layers, none is dots_saveable (see
  # model/blocks.py's _block_class).
  remat: str = 'none'
  # Run the identical blocks of each stack as one loop (nn.scan) over their
  # parameters stacked on a leading 'layers' axis, so that tracing and
  # compiling a step costs one group of blocks, whatever the depth
  # (MaxText's and levanter's default). The loop repeats the smallest group
  # that the attention pattern and MoE's every_n_layers repeat over;
  # value_residual's first block runs before it. Checkpoints of either
  # layout restore into the other (model/layer_stack.py).
  scan_layers: bool = False
  # rnn_attention only: the encoder's and decoder's recurrent cell, lstm or
  # gru, of width d_model.
  rnn_cell: str = 'lstm'
  # rnn_attention only: how the decoder state s scores an annotation h:
  # additive, v . tanh(W s + U h) (Bahdanau et al. 2015), or general,
  # s . W h (Luong et al. 2015).
  rnn_score: str = 'additive'
  # Mixture-of-experts feed-forward layers (see MoeConfig); from_mapping
  # accepts a dict.
  moe: MoeConfig = MoeConfig()
  # Language models on packed rows: the most windows of text a row holds.
  # The packer closes a row there (on every backend), and attention may
  # rely on it: cuDNN's packed layout
  # (model/attention/kernels/cudnn_packed.py) is sized by it, keeping
  # softmax statistics for batch x (this + 1) full-length sequences. Raise
  # it for many short documents at a long seq_len.
  max_segments_per_row: int = 32
  # decoder_lm only: Transformer-XL's segment-level recurrence (Dai et al.
  # 2019). Each layer also attends to the hidden states it saw in the last
  # `memory_length` positions of earlier segments (no gradient through
  # them); needs a relative position scheme. 0: off.
  memory_length: int = 0

  def __post_init__(self):
    # What needs the family (its name, what it can train) is checked by the
    # family registry: model.families.check.
    def fail(message):
      raise ValueError(message)

    def check_choice(name, choices):
      value = getattr(self, name)
      if value not in choices:
        fail(f'config.model.{name}={value!r} must be one of {list(choices)}.')

    def check_positive(name):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fail(f'config.model.{name}={value!r} must be a positive integer.')

    for name in ('vocab_size', 'd_model', 'num_heads', 'num_layers', 'mlp_dim',
                 'max_len', 'num_classes', 'relative_max_distance',
                 'relative_buckets', 'max_segments_per_row'):
      check_positive(name)
    check_choice('mlp_activation', ACTIVATIONS)
    check_choice('norm', NORMS)
    check_choice('qk_norm', ('none',) + NORMS)
    check_choice('norm_position', NORM_POSITIONS)
    check_choice('position', POSITIONS)
    scheme = SCHEMES[self.position]
    check_choice('pooling', POOLINGS)
    check_choice('dtype', DTYPES)
    check_choice('param_dtype', DTYPES)
    check_choice('remat', REMAT_POLICIES)
    check_choice('rnn_cell', RNN_CELLS)
    check_choice('rnn_score', RNN_SCORES)
    cap = self.logit_softcap
    if (isinstance(cap, bool) or not isinstance(cap, (int, float))
        or not 0 <= cap < math.inf):
      fail(f'config.model.logit_softcap={cap!r} must be a finite number >= '
           '0 (0: no cap).')
    for name in ('dropout_rate', 'attention_dropout_rate'):
      rate = getattr(self, name)
      if not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
        fail(f'config.model.{name}={rate!r} must be in [0, 1).')
    for name in ('tie_embeddings', 'attention_projections',
                 'zero_init_outputs', 'value_residual', 'scale_tied_readout',
                 'use_bias', 'scan_layers', 'unet_skips', 'smear',
                 'attention_sinks'):
      if not isinstance(getattr(self, name), bool):
        fail(f'config.model.{name}={getattr(self, name)!r} must be True or '
             'False.')
    tables = self.value_embeddings
    if (isinstance(tables, bool) or not isinstance(tables, int)
        or not 0 <= 2 * tables <= self.num_layers):
      fail(f'config.model.value_embeddings={tables!r} must be a whole number '
           f'from 0 to config.model.num_layers / 2 = {self.num_layers // 2} '
           '(a table serves a first and a last layer).')
    if self.unet_skips and self.num_layers < 2:
      fail('config.model.unet_skips joins the first half of the blocks to '
           f'the second; config.model.num_layers={self.num_layers} has one.')
    for name in ('value_embeddings', 'unet_skips'):
      if getattr(self, name) and self.scan_layers:
        fail(f'config.model.{name} treats layers differently, which '
             'config.model.scan_layers, one loop over identical blocks, '
             'cannot: set scan_layers=False.')
    for name in ('value_embeddings', 'unet_skips', 'smear'):
      if getattr(self, name) and self.memory_length:
        fail(f'config.model.{name} reads the tokens and hidden states of '
             'the positions it runs on, which a memory of earlier segments '
             'does not keep: set config.model.memory_length=0.')
    if not self.attention_projections and (self.value_residual
                                           or self.value_embeddings):
      name = 'value_residual' if self.value_residual else 'value_embeddings'
      fail(f'config.model.{name} mixes projected values; '
           'config.model.attention_projections=False projects none.')
    if not self.attention_projections and self.attention_sinks:
      fail('config.model.attention_sinks learns a logit per head, and '
           'config.model.attention_projections=False wants no parameters: '
           'set attention_sinks=False.')
    if not self.attention_projections and self.qk_norm != 'none':
      fail(f'config.model.qk_norm={self.qk_norm!r} scales queries and keys '
           'by parameters, and config.model.attention_projections=False '
           "wants none: set it to 'none'.")
    if not self.attention_projections and scheme.bias:
      unbiased = [name for name, s in SCHEMES.items() if not s.bias]
      fail(f'config.model.position={self.position!r} biases each head, and '
           'config.model.attention_projections=False leaves one head of '
           f"the model's width: use one of {unbiased}.")

    if isinstance(self.moe, dict):
      known = {field.name for field in dataclasses.fields(MoeConfig)}
      unknown = sorted(set(self.moe) - known)
      if unknown:
        fail(f'unknown key config.model.moe.{unknown[0]}; known keys: '
             f'{", ".join(sorted(known))}.')
      object.__setattr__(self, 'moe', MoeConfig(**self.moe))
    self.moe.check(fail)
    if self.moe.num_experts and self.moe.every_n_layers > self.num_layers:
      fail(f'config.model.moe.every_n_layers={self.moe.every_n_layers} '
           f'exceeds config.model.num_layers={self.num_layers}: no block '
           'would have experts.')
    if not isinstance(self.memory_length, int) or self.memory_length < 0:
      fail(f'config.model.memory_length={self.memory_length!r} must be an '
           'integer >= 0.')
    if (not isinstance(self.rope_max_wavelength, (int, float))
        or self.rope_max_wavelength <= 1):
      fail(f'config.model.rope_max_wavelength={self.rope_max_wavelength!r} '
           'must be a number > 1.')
    for name in ('norm_epsilon', 'embedding_init_stddev'):
      value = getattr(self, name)
      if (isinstance(value, bool) or not isinstance(value, (int, float))
          or not 0 < value < math.inf):
        fail(f'config.model.{name}={value!r} must be a finite number > 0.')
    fraction = self.rope_fraction
    if (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
        or not 0 < fraction <= 1):
      fail(f'config.model.rope_fraction={fraction!r} must be in (0, 1].')
    if fraction != 1 and not scheme.rotation:
      fail(f'config.model.rope_fraction={fraction!r} is the share of each '
           'head that rope rotates, and config.model.position='
           f'{self.position!r} rotates none.')
    if self.head_dim is None:
      if self.d_model % self.num_heads:
        fail(f'config.model.num_heads={self.num_heads} does not divide '
             f'config.model.d_model={self.d_model}; set config.model.head_dim '
             'to use heads of another width.')
      object.__setattr__(self, 'head_dim', self.d_model // self.num_heads)
    check_positive('head_dim')
    if self.num_kv_heads is None:
      object.__setattr__(self, 'num_kv_heads', self.num_heads)
    check_positive('num_kv_heads')
    if self.num_heads % self.num_kv_heads:
      fail(f'config.model.num_kv_heads={self.num_kv_heads} does not divide '
           f'config.model.num_heads={self.num_heads}.')
    rotated = self.head_dim * fraction
    if scheme.rotation and (rotated != round(rotated) or rotated < 2
                            or round(rotated) % 2):
      fail(f'config.model.position={self.position!r} rotates pairs of '
           'channels: config.model.rope_fraction * config.model.head_dim '
           f'= {fraction} * {self.head_dim} must be an even whole number.')
    if isinstance(self.attention, str) and ',' in self.attention:
      object.__setattr__(self, 'attention', tuple(
          name.strip() for name in self.attention.split(',')))
    if isinstance(self.attention_options, Mapping):
      object.__setattr__(self, 'attention_options',
                         self._options_by_entry(fail))
    if isinstance(self.attention, (tuple, list)):
      self._check_pattern(fail)
    else:
      self._check_attention(fail)
    scanned = self.num_layers - self.scan_start
    if self.scan_layers and scanned % self.scan_group:
      why = []
      if self.num_attentions > 1:
        why.append(f'config.model.attention cycles {self.num_attentions} '
                   'entries')
      if self.moe.num_experts:
        why.append('config.model.moe.every_n_layers='
                   f'{self.moe.every_n_layers}')
      first = ' after value_residual\'s first' if self.scan_start else ''
      fail(f'config.model.scan_layers repeats a group of {self.scan_group} '
           f'blocks ({" and ".join(why)}), which does not divide the '
           f'{scanned} blocks of config.model.num_layers={self.num_layers}'
           f'{first}; choose a num_layers it divides, or scan_layers=False.')

  def _options_by_entry(self, fail) -> tuple:
    """attention_options given as a mapping, as this config holds them:
    (name, value) pairs for one attention, a tuple of them per entry for
    several. The mapping holds options ({'window': 32}: one attention
    only) and options keyed by the attention's name ({'local':
    {'window': 32}})."""
    several = isinstance(self.attention, (tuple, list))
    names = tuple(self.attention) if several else (self.attention,)
    shown = ','.join(names)
    options = dict(self.attention_options)
    by_name = {key: dict(options.pop(key)) for key in list(options)
               if isinstance(options[key], Mapping)}
    for key in sorted(by_name.keys() - set(names)):
      fail(f'config.model.attention_options.{key} names no entry of '
           f'config.model.attention={shown!r}.')
    if options and several:
      option = sorted(options)[0]
      fail(f'config.model.attention_options.{option} names no entry of '
           f'config.model.attention={shown!r}; with several attentions, '
           'options are keyed by their names: config.model.'
           f'attention_options.<name>.{option}.')
    if options and by_name:
      fail(f'config.model.attention_options sets {sorted(options)} and '
           f'{self.attention}: {sorted(by_name[self.attention])}; give the '
           'options of one attention in one of the two places.')
    occurrences = {
        name: self._by_occurrence(name, names, by_name.get(name, options),
                                  name in by_name, fail)
        for name in dict.fromkeys(names)}
    per_entry = tuple(
        tuple(sorted((option, values[names[:index].count(name)])
                     for option, values in occurrences[name].items()))
        for index, name in enumerate(names))
    return per_entry if several else per_entry[0]

  def _by_occurrence(self, name: str, names: tuple[str, ...],
                     options: Mapping[str, Any], keyed: bool,
                     fail) -> dict[str, tuple]:
    """{option: its value at each occurrence of attention `name` in the
    pattern `names`}: one value repeated, or one given per occurrence
    (`_values`). `keyed`: the options were set under the attention's
    name."""
    count = names.count(name)
    resolved = self._resolved(name)
    types = (variant_options.option_types(resolved)
             if resolved in attention.names() else {})
    found = {}
    for option, value in options.items():
      key = ('config.model.attention_options.' + (f'{name}.' if keyed else '')
             + option)
      values = occurrence_values(value)
      if values is None:
        values = (value,) * count
      elif len(values) != count:
        wanted = ('once: give one value' if count == 1 else
                  f'{count} times: give one value, or one per occurrence')
        fail(f'{key}={value!r} gives {len(values)} values; config.model.'
             f'attention={",".join(names)!r} names {name} {wanted}.')
      kind = types.get(option)
      try:
        found[option] = tuple(_typed(one, kind) for one in values)
      except ValueError:
        fail(f'{key}={value!r} must be of type {kind.__name__}'
             + (f', one per occurrence of {name}.' if count > 1 else '.'))
    return found

  def _check_pattern(self, fail) -> None:
    """Several attentions: each entry, with its options, is checked as the
    attention of the layers it serves."""
    names = tuple(self.attention)
    options = self.attention_options
    if options == ():
      options = ((),) * len(names)
    if len(options) != len(names):
      fail(f'config.model.attention_options={options!r} must give the '
           f'options of each of the {len(names)} entries of '
           f'config.model.attention={",".join(names)!r}.')
    object.__setattr__(self, 'attention', names)
    object.__setattr__(self, 'attention_options', options)
    resolved = []
    for index in range(len(names)):
      try:
        resolved.append(self.for_layer(index).attention)  # 'auto' resolved.
      except ValueError as error:
        fail(f'config.model.attention[{index}]: {error}')
    object.__setattr__(self, 'attention', tuple(resolved))

  def _resolved(self, name: str) -> str:
    """The attention `name` stands for, for this config's attention
    dropout."""
    return resolved(name, dropout=self.attention_dropout_rate > 0)

  def _check_attention(self, fail) -> None:
    """The one attention: a registered name (`auto` resolved) and its
    dropout. What it must honour in the model: model.families.check."""
    if self.attention not in ['auto'] + attention.names():
      fail(f'config.model.attention={self.attention!r} must be one of '
           f"{['auto'] + attention.names()}.")
    object.__setattr__(self, 'attention', self._resolved(self.attention))
    variant = attention.spec(self.attention)
    if self.attention_dropout_rate > 0 and not variant.dropout:
      fail(f'config.model.attention={self.attention!r} has no attention '
           'dropout; set config.model.attention_dropout_rate=0.')

  @property
  def num_attentions(self) -> int:
    """Entries of the attention pattern (1 for a single attention)."""
    return len(self.attention) if isinstance(self.attention, tuple) else 1

  def option_key(self, name: str, option: str) -> str:
    """The config key of `option` of the attention `name`: under the
    attention's name where the model cycles several."""
    return ('config.model.attention_options.'
            + (f'{name}.' if self.num_attentions > 1 else '') + option)

  def for_layer(self, layer: int) -> 'ModelConfig':
    """This config with layer `layer`'s attention and options: the entry
    `layer % num_attentions` of a list; itself for a single attention."""
    if not isinstance(self.attention, tuple):
      return self
    index = layer % len(self.attention)
    return dataclasses.replace(self, attention=self.attention[index],
                               attention_options=self.attention_options[index])

  @property
  def scan_group(self) -> int:
    """Blocks in the group that scan_layers repeats: the least number after
    which both the attention pattern and the MoE layers repeat."""
    return math.lcm(self.num_attentions, self.moe.every_n_layers
                    if self.moe.num_experts else 1)

  @property
  def scan_start(self) -> int:
    """Blocks run one by one before the scanned groups: value_residual's
    first, whose values the others mix with (one layer alone mixes
    none)."""
    return 1 if self.value_residual and self.num_layers > 1 else 0

  def value_embedding_table(self, layer: int) -> int | None:
    """The value embedding table (config.value_embeddings) whose rows
    layer `layer` adds to its values, or None."""
    tables = self.value_embeddings
    if layer < tables:
      return layer
    last = self.num_layers - tables
    return layer - last if layer >= last else None

  def layer_configs(self) -> tuple['ModelConfig', ...]:
    """One config per entry of the attention pattern."""
    return tuple(self.for_layer(i) for i in range(self.num_attentions))

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> 'ModelConfig':
    """Builds a ModelConfig from `config.model`, rejecting unknown keys."""
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(
          f'unknown key config.model.{unknown[0]}; known keys: '
          f'{", ".join(sorted(known))}.')
    values = dict(values)
    for name in ('attention_options', 'moe'):
      if hasattr(values.get(name), 'to_dict'):  # An ml_collections ConfigDict.
        values[name] = values[name].to_dict()
    if isinstance(values.get('attention_options'), Mapping):
      values['attention_options'] = _set_options(values['attention_options'])
    return cls(**values)

  def has_moe(self, layer: int) -> bool:
    """Whether block `layer`'s feed-forward layer is a mixture of experts."""
    return bool(self.moe.num_experts) and (
        (layer + 1) % self.moe.every_n_layers == 0)

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)
