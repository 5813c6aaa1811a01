"""A mixture-of-experts feed-forward layer (Shazeer et al. 2017).

A router scores each token against `num_experts` experts (each a
feed-forward layer of the model's shape); the token goes to its `top_k`
best, weighted by the router's softmax (renormalised over the chosen two
for top-2, as GShard does). Tokens are routed in groups of G consecutive
tokens of an example (`group_size`; by default the whole example, G = T).
Each expert has room for C = ceil(capacity_factor * G * top_k / E) tokens
of a group, taken in order along the sequence (so that routing never reads
a later token: GShard places every first choice before any second one,
which would let a later token's choice push out an earlier token's), and
what does not fit is dropped (the block's residual connection carries the
token on). Tokens reach their experts and come back through one-hot
dispatch and combine tensors [B * ceil(T / G), G, E, C] (T * E * C
entries an example: quadratic in T for one group, linear for a fixed G),
so every shape is static and the experts run as one batched matmul (a
group's last tokens are padding where G does not divide T: they choose no
expert, and take no room). Their parameters carry the logical axis
`expert`, which config.logical_axis_rules may map onto a mesh axis to
spread the experts over devices.

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

from model import activations
from model.config import ModelConfig
from model.weight_decay import undecayed

Array = jax.Array

def group_size(config: ModelConfig, length: int) -> int:
  """Tokens routed together for an input of `length` tokens an example."""
  return min(config.moe.group_size or length, length)


def capacity(config: ModelConfig, group: int) -> int:
  """Tokens of a group of `group` tokens each expert takes."""
  moe = config.moe
  return max(1, math.ceil(moe.capacity_factor * group * moe.top_k
                          / moe.num_experts))


def route(probs_BxTxE: Array, top_k: int, expert_capacity: int,
          valid_BxT: Array | None = None) -> tuple[Array, Array, Array]:
  """(dispatch [B, T, E, C] 0/1, combine [B, T, E, C] gate weights, dropped
  token choices [B]) for router probabilities [B, T, E], each row of B a
  group routed alone; tokens not `valid_BxT` choose no expert."""
  num_experts = probs_BxTxE.shape[-1]
  gates_BxTxK, experts_BxTxK = jax.lax.top_k(probs_BxTxE, top_k)
  if top_k > 1:
    gates_BxTxK = gates_BxTxK / jnp.sum(gates_BxTxK, axis=-1, keepdims=True)
  # Room is taken in sequence order (a token's choices before the next
  # token's), so a token's routing depends on earlier tokens only and a
  # decoder stays causal.
  chosen_BxTxKxE = jax.nn.one_hot(experts_BxTxK, num_experts,
                                  dtype=jnp.int32)
  if valid_BxT is not None:
    chosen_BxTxKxE = chosen_BxTxKxE * valid_BxT[:, :, None, None]
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
    num_experts = config.moe.num_experts
    batch, length, width = x_BxTxD.shape
    dtype = config.compute_dtype

    def param(name, shape, axes, init, box=nn.with_logical_partitioning):
      return self.param(name, box(init, axes), shape, config.weight_dtype)

    def expert_init(rng, shape, dtype):  # Xavier per expert.
      return jax.vmap(lambda key: nn.initializers.xavier_uniform()(
          key, shape[1:], dtype))(jax.random.split(rng, shape[0]))

    router_DxE = param('router', (width, num_experts), ('embed', None),
                       nn.initializers.normal(stddev=0.02))
    probs_BxTxE = jax.nn.softmax(
        jnp.einsum('btd,de->bte', x_BxTxD.astype(jnp.float32),
                   router_DxE.astype(jnp.float32)), axis=-1)
    # R = B * ceil(T / G) groups of G tokens, the last padded.
    group = group_size(config, length)
    padded = -(-length // group) * group

    def grouped(array_BxTx_):
      array_BxPx_ = jnp.pad(array_BxTx_, [(0, 0), (0, padded - length)]
                            + [(0, 0)] * (array_BxTx_.ndim - 2))
      return array_BxPx_.reshape(-1, group, *array_BxTx_.shape[2:])

    dispatch_RxGxExC, combine_RxGxExC, dropped_R = route(
        grouped(probs_BxTxE), config.moe.top_k, capacity(config, group),
        grouped(jnp.ones((batch, length), jnp.int32)))
    inputs_ExRxCxD = jnp.einsum('rgec,rgd->ercd',
                                dispatch_RxGxExC.astype(dtype),
                                grouped(x_BxTxD).astype(dtype))

    def up(name):
      kernel = param(name, (num_experts, width, config.mlp_dim),
                     ('expert', 'embed', 'mlp'), expert_init)
      hidden_ExRxCxM = jnp.einsum('ercd,edm->ercm', inputs_ExRxCxD,
                                  kernel.astype(dtype))
      if not config.use_bias:
        return hidden_ExRxCxM
      bias = param(f'{name}_bias', (num_experts, config.mlp_dim),
                   ('expert', 'mlp'), nn.initializers.zeros, undecayed)
      return hidden_ExRxCxM + bias.astype(dtype)[:, None, None]

    hidden = activations.hidden(config.mlp_activation, up)
    wo = param('wo', (num_experts, config.mlp_dim, width),
               ('expert', 'mlp', 'embed'),
               nn.initializers.zeros if config.zero_init_outputs
               else expert_init)
    outputs_ExRxCxD = jnp.einsum('ercm,emd->ercd', hidden, wo.astype(dtype))
    if config.use_bias:
      wo_bias = param('wo_bias', (num_experts, width), ('expert', 'embed'),
                      nn.initializers.zeros, undecayed)
      outputs_ExRxCxD = outputs_ExRxCxD + wo_bias.astype(dtype)[:, None, None]
    # Padding tokens of the batch are routed too, and counted in the
    # balance (the groups' padding is not).
    self.sow('moe', 'aux_loss', load_balancing_loss(probs_BxTxE))
    self.sow('moe', 'dropped', jnp.sum(dropped_R).astype(jnp.float32))
    self.sow('moe', 'assigned', jnp.asarray(
        batch * length * config.moe.top_k, jnp.float32))
    out_RxGxD = jnp.einsum('rgec,ercd->rgd', combine_RxGxExC.astype(dtype),
                           outputs_ExRxCxD)
    return out_RxGxD.reshape(batch, padded, width)[:, :length]
