"""What experiments/bench_attention.py times: the variants by name (a fused
kernel in brackets), the masks of each kind of rows, and each variant as a
function of its parameters and inputs.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import ModelConfig, attention, positions
from model.attention import options as variant_options
from model.attention.kernels import fused
from train.base.errors import InputError, did_you_mean

# Variants that compute softmax(q k^T) v exactly (the FLOP count applies):
# the fused kernel's row ('xla') and the registry's exact ones.
EXACT = ('xla', *attention.exact_names())
# The rows a run can measure: no mask, packed documents, right padding,
# and plain rows under ALiBi's position bias (Press et al. 2022), T5's
# learned buckets (Raffel et al. 2020) or logits capped at CAP (Gemma 2).
ROWS = ('plain', 'packed', 'padded', 'alibi', 't5', 'capped')
CAP = 30.0
# Runs of one id in each packed row of `segment_ids` (7 // 2 + 1).
PACKED_SEGMENTS = 4


def parse_variant(name: str) -> tuple[str, str | None]:
  """'chunked[cudnn]' -> ('chunked', 'cudnn'); 'dense' -> ('dense', None).

  Raises:
    InputError: an unknown variant, or a kernel it does not take.
  """
  match = re.fullmatch(r'(\w+)(?:\[(\w+)\])?', name)
  base, kernel = match.groups() if match else (name, None)
  known = ['xla', *attention.names()]
  if base not in known:
    raise InputError(f'--variants: unknown attention {name!r}'
                     f'{did_you_mean(base, known)} Registered: '
                     f'{", ".join(known)}.')
  if kernel is None:
    return base, None
  if not variant_options.takes_kernel(base):
    takers = [n for n in attention.names()
              if variant_options.takes_kernel(n)]
    raise InputError(f'--variants: {name!r}: {base} takes no kernel; '
                     f'{", ".join(takers)} do.')
  if kernel not in fused.KERNELS:
    raise InputError(f'--variants: {name!r}: no kernel {kernel!r}'
                     f'{did_you_mean(kernel, fused.KERNELS)} The kernels: '
                     f'{", ".join(fused.KERNELS)}.')
  return base, kernel


def default_variants(backend: str) -> list[str]:
  """xla and every registered variant; where the backend has fused
  kernels, chunked by its JAX code and by each of them too."""
  kernels = fused.AUTO_ORDER.get(backend, ())
  by_kernel = [f'chunked[{k}]' for k in ('xla', *kernels)] if kernels else []
  return ['xla', *attention.names(), *by_kernel]


def segment_ids(batch: int, length: int) -> jax.Array:
  """int32 [B, T]: documents of about 2T/7 positions packed in each row
  (7 being odd, their ends fall inside any power-of-two block)."""
  ids = jnp.arange(length) * 7 // (2 * length)
  return jnp.broadcast_to(ids, (batch, length)).astype(jnp.int32)


def rows_mask(rows: str, batch: int, length: int):
  """The mask of `rows` (one of ROWS) as the variants take it: None
  (plain), a SegmentMask (packed) or a key padding mask bool [B, 1, 1, S]
  (padded: the first 3T/4 + 1 keys real, the rest right padding)."""
  if rows == 'packed':
    return attention.SegmentMask(segment_ids(batch, length),
                                 max_segments=PACKED_SEGMENTS)
  if rows == 'padded':
    valid_S = jnp.arange(length) < length * 3 // 4 + 1
    return jnp.broadcast_to(valid_S, (batch, 1, 1, length))
  return None


def rows_bias(rows: str, batch: int, length: int, heads: int):
  """The position bias of `rows` (a PositionBias): ALiBi's for 'alibi'
  rows, T5's (causal buckets, a table drawn once) for 't5' rows, else
  None."""
  if rows not in ('alibi', 't5'):
    return None
  positions_BxT = jnp.broadcast_to(jnp.arange(length), (batch, length))
  if rows == 'alibi':
    return positions.alibi_bias(positions_BxT, positions_BxT, heads)
  table = 0.1 * jax.random.normal(jax.random.key(2), (32, heads))
  return positions.T5Bias(heads, 32, 128, bidirectional=False).apply(
      {'params': {'embedding': table}}, positions_BxT, positions_BxT)


def xla_attention(q, k, v, mask, bias, *, causal: bool) -> jax.Array:
  """`jax.nn.dot_product_attention` [B, T, N, H] under a mask of
  `rows_mask`, given as it takes it: packed rows as the [B, 1, T, S] mask
  their ids compare to, right padding as each row's number of keys; a
  position bias as the [B, N, T, S] array it stands for."""
  if bias is not None:
    indices = jnp.arange(q.shape[1])
    bias = bias.at(indices[:, None], indices[None]).astype(q.dtype)
  if isinstance(mask, attention.SegmentMask):
    ids_BxT = mask.q_segment_ids_BxT
    return jax.nn.dot_product_attention(
        q, k, v, bias, mask=ids_BxT[:, None, :, None] == ids_BxT[:, None,
                                                                 None, :],
        is_causal=causal)
  lengths_B = (None if mask is None
               else jnp.sum(mask[:, 0, 0], axis=1, dtype=jnp.int32))
  return jax.nn.dot_product_attention(q, k, v, bias, is_causal=causal,
                                      key_value_seq_lengths=lengths_B)


class Attend(nn.Module):
  """A registered variant with the parameters it owns (Linformer's
  projections, additive attention's weights, a recurrence's gates) created
  in its scope."""

  config: ModelConfig
  is_causal: bool

  @nn.compact
  def __call__(self, q, k, v, mask, bias=None):
    kwargs = variant_options.variant_kwargs(self, self.config)
    if attention.spec(self.config.attention).reads_inputs:
      # The layer's input its gates read: here the queries, [B, T, N * H].
      kwargs['inputs'] = q.reshape(*q.shape[:2], -1)
    return attention.get(self.config.attention)(
        q, k, v, bias, mask, is_causal=self.is_causal, **kwargs)


def variant_fn(name: str, rows: str, length: int, options: dict, *,
               causal: bool, heads: int, head_dim: int, q, mask, bias):
  """(fn(params, q, k, v, mask, bias), params), or a string saying why
  not.

  Raises:
    fused.KernelError: the kernel named in brackets refuses the case.
  """
  if name == 'xla':
    return (lambda params, q, k, v, mask, bias: xla_attention(
        q, k, v, mask, bias, causal=causal)), {}
  base, kernel = parse_variant(name)
  variant = attention.spec(base)
  if rows == 'packed' and not variant.packs:
    return f'{name} takes key padding masks only, not packed rows'
  if rows in ('alibi', 't5') and not variant.bias:
    return f'{name} takes no position bias'
  if rows == 'capped' and 'logit_cap' not in variant_options.option_names(
      base):
    return f'{name} takes no cap on its logits'
  if causal and not variant.causal:
    return f'{name} is not causal'
  if base == 'ring':
    return ('ring needs a mesh with a sequence axis '
            '(tests/model/attention/variants/test_ring.py)')
  options = options.get(base, {}) | ({'kernel': kernel} if kernel else {})
  if rows == 'capped':
    options['logit_cap'] = CAP
  config = ModelConfig(attention=base, num_heads=heads, head_dim=head_dim,
                       d_model=heads * head_dim, max_len=length,
                       attention_options=tuple(options.items()))
  module = Attend(config, causal)
  # Jitted, so that the forward pass it traces is never run.
  return module.apply, jax.jit(module.init)(jax.random.key(0), q, q, q, mask,
                                            bias)
