"""A mixture-of-experts feed-forward layer (Shazeer et al. 2017).

A router scores each token against `num_experts` experts (each a
feed-forward layer of the model's shape); the token goes to its `top_k`
best, weighted by the router's softmax (renormalised over the chosen two
for top-2, as GShard does). Each expert has room for C = ceil(
capacity_factor * T * top_k / E) tokens of an example, taken in order
along the sequence (so that routing never reads a later token: GShard
places every first choice before any second one, which would let a later
token's choice push out an earlier token's), and what does not fit is
dropped (the block's residual connection carries the token on).
Tokens reach their experts and come back through one-hot dispatch and
combine tensors [B, T, E, C], so every shape is static and the experts run
as one batched matmul; their parameters carry the logical axis `expert`,
which config.logical_axis_rules may map onto a mesh axis to spread the
experts over devices.

The layer sows into the 'moe' collection: the load-balancing loss of Switch
(Fedus et al. 2022), E * sum_e f_e P_e with f_e the fraction of tokens whose
first choice is e and P_e the mean router probability of e (1 when routing
is uniform, E when one expert takes everything), the token choices dropped
and the token choices made.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import ModelConfig

Array = jax.Array

_ACTIVATIONS = {'relu': nn.relu, 'gelu': nn.gelu}


def capacity(config: ModelConfig, length: int) -> int:
  """Tokens of an example each expert takes."""
  moe = config.moe
  return max(1, math.ceil(moe.capacity_factor * length * moe.top_k
                          / moe.num_experts))


def route(probs_BxTxE: Array, top_k: int, expert_capacity: int
          ) -> tuple[Array, Array, Array]:
  """(dispatch [B, T, E, C] 0/1, combine [B, T, E, C] gate weights, dropped
  token choices [B]) for router probabilities [B, T, E]."""
  num_experts = probs_BxTxE.shape[-1]
  gates_BxTxK, experts_BxTxK = jax.lax.top_k(probs_BxTxE, top_k)
  if top_k > 1:
    gates_BxTxK = gates_BxTxK / jnp.sum(gates_BxTxK, axis=-1, keepdims=True)
  # Room is taken in sequence order (a token's choices before the next
  # token's), so a token's routing depends on earlier tokens only and a
  # decoder stays causal.
  chosen_BxTxKxE = jax.nn.one_hot(experts_BxTxK, num_experts,
                                  dtype=jnp.int32)
  batch, length = chosen_BxTxKxE.shape[:2]
  flat = chosen_BxTxKxE.reshape(batch, length * top_k, num_experts)
  slot_BxTxKxE = (jnp.cumsum(flat, axis=1) - flat).reshape(
      chosen_BxTxKxE.shape)
  kept_BxTxKxE = chosen_BxTxKxE * (slot_BxTxKxE < expert_capacity)
  slots_BxTxKxExC = jax.nn.one_hot(slot_BxTxKxE, expert_capacity,
                                   dtype=jnp.float32) * kept_BxTxKxE[..., None]
  dispatch = jnp.sum(slots_BxTxKxExC, axis=2)
  combine = jnp.einsum('btkec,btk->btec', slots_BxTxKxExC,
                       gates_BxTxK.astype(jnp.float32))
  dropped_B = jnp.sum(chosen_BxTxKxE - kept_BxTxKxE, axis=(1, 2, 3))
  return dispatch, combine, dropped_B


def load_balancing_loss(probs_BxTxE: Array) -> Array:
  """Switch's E * sum_e f_e P_e over every position: f_e the fraction of
  tokens whose first choice is e, P_e the mean probability of e."""
  num_experts = probs_BxTxE.shape[-1]
  first = jax.nn.one_hot(jnp.argmax(probs_BxTxE, axis=-1), num_experts)
  fraction_E = jnp.mean(first, axis=(0, 1))
  mean_prob_E = jnp.mean(probs_BxTxE, axis=(0, 1))
  return num_experts * jnp.sum(fraction_E * mean_prob_E)


class MoeMlp(nn.Module):
  """`config.moe.num_experts` feed-forward experts behind a top-k router;
  [B, T, D] -> [B, T, D]."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD: Array) -> Array:
    config = self.config
    num_experts, width = config.moe.num_experts, x_BxTxD.shape[-1]
    dtype = config.compute_dtype

    def param(name, shape, axes, init):
      return self.param(name, nn.with_logical_partitioning(init, axes),
                        shape, config.weight_dtype)

    def expert_init(rng, shape, dtype):  # Xavier per expert.
      return jax.vmap(lambda key: nn.initializers.xavier_uniform()(
          key, shape[1:], dtype))(jax.random.split(rng, shape[0]))

    router_DxE = param('router', (width, num_experts), ('embed', None),
                       nn.initializers.normal(stddev=0.02))
    probs_BxTxE = jax.nn.softmax(
        jnp.einsum('btd,de->bte', x_BxTxD.astype(jnp.float32),
                   router_DxE.astype(jnp.float32)), axis=-1)
    dispatch, combine, dropped_B = route(
        probs_BxTxE, config.moe.top_k, capacity(config, x_BxTxD.shape[1]))
    inputs_ExBxCxD = jnp.einsum('btec,btd->ebcd', dispatch.astype(dtype),
                                x_BxTxD.astype(dtype))

    def up(name):
      kernel = param(name, (num_experts, width, config.mlp_dim),
                     ('expert', 'embed', 'mlp'), expert_init)
      bias = param(f'{name}_bias', (num_experts, config.mlp_dim),
                   ('expert', 'mlp'), nn.initializers.zeros)
      return (jnp.einsum('ebcd,edm->ebcm', inputs_ExBxCxD,
                         kernel.astype(dtype))
              + bias.astype(dtype)[:, None, None])

    if config.mlp_activation == 'swiglu':
      hidden = nn.silu(up('wi_gate')) * up('wi')
    else:
      hidden = _ACTIVATIONS[config.mlp_activation](up('wi'))
    wo = param('wo', (num_experts, config.mlp_dim, width),
               ('expert', 'mlp', 'embed'), expert_init)
    wo_bias = param('wo_bias', (num_experts, width), ('expert', 'embed'),
                    nn.initializers.zeros)
    outputs_ExBxCxD = (jnp.einsum('ebcm,emd->ebcd', hidden, wo.astype(dtype))
                       + wo_bias.astype(dtype)[:, None, None])
    # Padding positions are routed too, and counted in the balance.
    self.sow('moe', 'aux_loss', load_balancing_loss(probs_BxTxE))
    self.sow('moe', 'dropped', jnp.sum(dropped_B).astype(jnp.float32))
    self.sow('moe', 'assigned', jnp.asarray(
        x_BxTxD.shape[0] * x_BxTxD.shape[1] * config.moe.top_k, jnp.float32))
    return jnp.einsum('btec,ebcd->btd', combine.astype(dtype),
                      outputs_ExBxCxD)
