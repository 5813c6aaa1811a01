"""Model FLOPs of a training step and the peak of the devices: model FLOPs
utilisation (MFU, Chowdhery et al. 2022), the fraction of the peak that
goes to the model's own arithmetic (recomputation under remat not
counted).

Per token, forward and backward: 6 N (N the parameters outside the
embedding table, each used in one multiply-add forward and two backward)
plus 6 L T d for attention over T positions (Kaplan et al. 2020), plus
6 d V for the output projection. Counted on the padded [batch, seq_len]
shapes a step computes, so padding costs what it costs.
"""

import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp

from model import ModelConfig
from model.families import FAMILIES
from train.data.tasks import Task

# Dense bfloat16 peak of one chip, FLOP/s, by a part of jax's device_kind.
PEAK_BF16_FLOPS = (
    ('H100', 989e12), ('H200', 989e12), ('A100', 312e12),
    ('TPU v5p', 459e12), ('TPU v5 lite', 197e12), ('TPU v5e', 197e12),
    ('TPU v6 lite', 918e12), ('TPU v6e', 918e12), ('TPU v4', 275e12),
)


def non_embedding_params(params: Any, expert_fraction: float = 1.0
                         ) -> float:
  """Parameters outside the embedder (the token table, a learned position
  table and an untied output projection, which 6 d V counts) that a token
  goes through: each mixture-of-experts layer's experts count
  `expert_fraction` of theirs (top_k / num_experts), its router all."""
  total = 0.0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    keys = [getattr(key, 'key', None) for key in path]
    if 'embedder' in keys:
      continue
    expert = 'moe' in keys and keys[-1] != 'router'
    total += leaf.size * (expert_fraction if expert else 1.0)
  return total


def train_flops_per_example(config: ModelConfig, task: Task, seq_len: int,
                            num_params: int) -> float:
  """Forward and backward FLOPs of one example of `seq_len` tokens (and as
  many targets for seq2seq); `num_params` from `non_embedding_params`."""
  attention_layers = FAMILIES[config.family].attention_layers(config)
  flops = seq_len * (6 * num_params
                     + 6 * attention_layers * seq_len * config.d_model)
  if task.vocabulary_logits:
    flops += 6 * seq_len * config.d_model * config.vocab_size
  return float(flops)


@functools.cache
def measured_matmul_flops_per_s(size: int = 2048, repeats: int = 5) -> float:
  """The speed of a jitted float32 size x size matmul on one device of the
  default backend (the best of `repeats` + 1 runs): the peak of a CPU,
  which publishes none."""
  x = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(jnp.matmul).lower(x, x).compile()
  best = float('inf')
  for _ in range(repeats + 1):
    start = time.perf_counter()
    jax.block_until_ready(matmul(x, x))
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best


def peak_flops_per_device() -> float | None:
  """The published bfloat16 peak of a GPU or TPU chip, or on CPU the
  measured matmul speed; None for a chip not in PEAK_BF16_FLOPS."""
  device = jax.devices()[0]
  if device.platform == 'cpu':
    return measured_matmul_flops_per_s()
  for name, flops in PEAK_BF16_FLOPS:
    if name in device.device_kind:
      return flops
  return None


def peak_flops_per_s() -> float | None:
  """Peak FLOP/s of all devices together (the simulated CPU devices of one
  machine share its cores: its matmul speed)."""
  per_device = peak_flops_per_device()
  if per_device is None or jax.devices()[0].platform == 'cpu':
    return per_device
  return per_device * jax.device_count()


# Substrings of a primitive's name that mark a fused kernel, whose matmuls
# the jaxpr does not show (cuDNN's: dot_product_attention_fwd, _bwd, ...).
FUSED_PRIMITIVES = ('pallas', 'custom_call', 'dot_product_attention')


def matmul_flops(jaxpr) -> float | None:
  """FLOPs of the matmuls (dot_general) in `jaxpr` and the jaxprs inside
  it, a scan's body counted once per step, a cond's costliest branch;
  None where they cannot be counted from the jaxpr: a while loop (its
  trip count) or a fused kernel (pallas_call, cuDNN's attention
  primitives, or XLA's custom calls)."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == 'while' or any(kernel in name for kernel in FUSED_PRIMITIVES):
      return None
    if name == 'dot_general':
      (contracting, _), _ = eqn.params['dimension_numbers']
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(
          lhs[i] for i in contracting)
    inner = []
    for param in eqn.params.values():
      for value in param if isinstance(param, (tuple, list)) else [param]:
        value = getattr(value, 'jaxpr', value)
        if isinstance(value, jax.extend.core.Jaxpr):
          inner.append(matmul_flops(value))
    if None in inner:
      return None
    if inner:
      steps = eqn.params.get('length', 1) if name == 'scan' else 1
      total += steps * (max(inner) if name == 'cond' else sum(inner))
  return total
