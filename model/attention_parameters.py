"""Parameters that some attention variants own, created by MultiHeadAttention.

A variant named here gets its parameters from a function called inside
`MultiHeadAttention`'s scope with (module, config, options); it returns the
keyword arguments the variant's pure function takes, and the options left
for that function. Adding such a variant needs an entry here and in the
registry, and no change to the model.
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn

from model.config import ModelConfig


def _linformer(module: nn.Module, config: ModelConfig,
               options: dict[str, Any]) -> dict[str, Any]:
  """E and F [rank, max_len], Gaussian with variance 1 / rank."""
  options = dict(options)
  rank = options.pop('rank', 64)
  init = nn.with_logical_partitioning(
      nn.initializers.normal(stddev=rank ** -0.5), (None, 'length'))
  return options | {
      'key_projection': module.param('linformer_key', init,
                                     (rank, config.max_len),
                                     config.weight_dtype),
      'value_projection': module.param('linformer_value', init,
                                       (rank, config.max_len),
                                       config.weight_dtype)}


def _additive(module: nn.Module, config: ModelConfig,
              options: dict[str, Any]) -> dict[str, Any]:
  """W_q, W_k [N, H, A] and v [N, A]; A = options['hidden'] (default H)."""
  options = dict(options)
  hidden = options.pop('hidden', config.head_dim)
  heads, head_dim = config.num_heads, config.head_dim
  matrix = nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                        ('heads', 'kv', None))
  vector = nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                        ('heads', None))
  return options | {
      'query_weight': module.param('additive_query', matrix,
                                   (heads, head_dim, hidden),
                                   config.weight_dtype),
      'key_weight': module.param('additive_key', matrix,
                                 (heads, head_dim, hidden),
                                 config.weight_dtype),
      'score_weight': module.param('additive_score', vector, (heads, hidden),
                                   config.weight_dtype)}


PARAMETERS: dict[str, Callable[..., dict[str, Any]]] = {
    'linformer': _linformer,
    'additive': _additive,
}


def variant_kwargs(module: nn.Module, config: ModelConfig) -> dict[str, Any]:
  """The keyword arguments of `config.attention` for this module: its
  options, with any parameters it owns created and passed in."""
  options = dict(config.attention_options)
  if config.attention in PARAMETERS:
    return PARAMETERS[config.attention](module, config, options)
  return options
