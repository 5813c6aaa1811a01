"""`additive`: Bahdanau et al. (2015)'s attention score, per head:

  score(q_i, k_j) = v . tanh(W_q q_i + W_k k_j)

the attention of RNN translation, on the core's signature. W_q, W_k [N, H, A]
and v [N, A] are parameters (`parameters`, which `MultiHeadAttention` calls
in its scope) that the model passes in. It forms a [B, T, S, N, A]
tensor: O(T * S * A) memory, the price of a score that is not a dot
product.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention import core

Array = jax.Array


def additive_attention(query: Array, key: Array, value: Array,
                       bias: Array | None = None, mask: Array | None = None,
                       *, scale: float | None = None, is_causal: bool = False,
                       query_weight: Array, key_weight: Array,
                       score_weight: Array, sinks: Array | None = None
                       ) -> Array:
  """softmax over keys of the additive score (plus bias, masked) times v.

  Args:
    query_weight: W_q [N, H, A].
    key_weight: W_k [N, H, A]; query head n reads key head n // (N // K).
    score_weight: v [N, A].
    sinks: as dense's.
  """
  core.check_inputs(query, key, value, bias, mask)
  core.check_sinks(sinks, query.shape[2])
  if scale is not None:
    raise ValueError('additive attention has no logit scale; leave scale '
                     'None.')
  num_heads, num_kv_heads = query.shape[2], key.shape[2]
  projected_q = jnp.einsum('btnh,nha->btna', query, query_weight)
  key_per_head = jnp.repeat(key, num_heads // num_kv_heads, axis=2)
  projected_k = jnp.einsum('bsnh,nha->bsna', key_per_head, key_weight)
  hidden_BxTxSxNxA = jnp.tanh(projected_q[:, :, None] + projected_k[:, None])
  logits_BxNxTxS = jnp.einsum('btsna,na->bnts', hidden_BxTxSxNxA,
                              score_weight,
                              preferred_element_type=jnp.float32)
  weights = core.weights_from_logits(logits_BxNxTxS, bias, mask, is_causal,
                                     sinks)
  return core.weighted_values(weights, value, query.dtype)


def parameters(module: nn.Module, config, *, hidden: int | None = None,
               **options) -> dict[str, Any]:
  """W_q, W_k [N, H, A] and v [N, A], A = `hidden` (default H), created in
  `module` for a layer of `config` (a ModelConfig); with the other
  `options`, the keyword arguments of additive_attention."""
  hidden = config.head_dim if hidden is None else hidden
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
