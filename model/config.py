"""ModelConfig: the hyperparameters of every model family, validated.

Configs under `configs/` hold these keys in `config.model`; `ModelConfig.
from_mapping(config.model)` turns them into this frozen (hashable) dataclass,
so a typo or an inconsistent size is reported, naming the key, before
anything is traced or compiled.
"""

from collections.abc import Mapping
import dataclasses
from typing import Any

import jax.numpy as jnp

from model import attention

FAMILIES = ('decoder_lm', 'encoder_decoder', 'encoder_classifier')
ACTIVATIONS = ('relu', 'gelu', 'swiglu')
NORMS = ('layernorm', 'rmsnorm')
NORM_POSITIONS = ('pre', 'post')
POSITIONS = ('sinusoidal', 'learned', 'none')
POOLINGS = ('cls', 'mean')
DTYPES = ('float32', 'bfloat16', 'float16')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Model hyperparameters. Token id 0 is padding in every family."""

  # Which model: decoder_lm (GPT-2), encoder_decoder (Vaswani et al. 2017),
  # encoder_classifier (an encoder with a pooled classification head).
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
  # Feed-forward nonlinearity: relu, gelu, or swiglu (Shazeer 2020).
  mlp_activation: str = 'gelu'
  # Normalisation layer: layernorm or rmsnorm (Zhang & Sennrich 2019).
  norm: str = 'layernorm'
  # pre: x + f(norm(x)) with a final norm (GPT-2); post: norm(x + f(x))
  # (Vaswani et al. 2017).
  norm_position: str = 'pre'
  # Absolute position information added to the embeddings: sinusoidal,
  # learned, or none.
  position: str = 'sinusoidal'
  # Longest sequence (in tokens) the learned position table covers.
  max_len: int = 512
  # Dropout on the embeddings and on every sublayer's output.
  dropout_rate: float = 0.0
  # Dropout on the attention weights.
  attention_dropout_rate: float = 0.0
  # Attention function, by its name in model.attention.names().
  attention: str = 'dense'
  # Output projection shares the token embedding matrix (Press & Wolf 2017).
  tie_embeddings: bool = True
  # encoder_classifier only: number of classes of the head.
  num_classes: int = 2
  # encoder_classifier only: cls (a learned token prepended to the input)
  # or mean (average over non-padding positions).
  pooling: str = 'cls'
  # Dtype of the computation (activations); logits and loss stay float32.
  dtype: str = 'float32'
  # Dtype in which parameters are stored.
  param_dtype: str = 'float32'
  # Recompute each block's activations in the backward pass (saves memory).
  remat: bool = False

  def __post_init__(self):
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
                 'max_len', 'num_classes'):
      check_positive(name)
    check_choice('family', FAMILIES)
    check_choice('mlp_activation', ACTIVATIONS)
    check_choice('norm', NORMS)
    check_choice('norm_position', NORM_POSITIONS)
    check_choice('position', POSITIONS)
    check_choice('pooling', POOLINGS)
    check_choice('dtype', DTYPES)
    check_choice('param_dtype', DTYPES)
    check_choice('attention', attention.names())
    for name in ('dropout_rate', 'attention_dropout_rate'):
      rate = getattr(self, name)
      if not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
        fail(f'config.model.{name}={rate!r} must be in [0, 1).')
    for name in ('tie_embeddings', 'remat'):
      if not isinstance(getattr(self, name), bool):
        fail(f'config.model.{name}={getattr(self, name)!r} must be True or '
             'False.')

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

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> 'ModelConfig':
    """Builds a ModelConfig from `config.model`, rejecting unknown keys."""
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(
          f'unknown key config.model.{unknown[0]}; known keys: '
          f'{", ".join(sorted(known))}.')
    return cls(**dict(values))

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)
