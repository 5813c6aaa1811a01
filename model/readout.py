"""The vocabulary readout: final hidden states and the output projection.

A `Readout` is what a language model's logits are computed from, kept
apart so that a loss can compute them a block of tokens at a time (see
train/program/cross_entropy.py) instead of materialising float32 [B, T, V].
`project` is the projection's matmul: operands in the compute dtype,
accumulation and result in float32, and so are its gradients' matmuls.
"""

import functools

import flax
import jax
import jax.numpy as jnp

from model.attention.core import softcap

Array = jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _project(x_BxTxD: Array, weights: Array, weights_spec: str,
             compute_dtype) -> Array:
  return jnp.einsum(f'btd,{weights_spec}->btv', x_BxTxD.astype(compute_dtype),
                    weights.astype(compute_dtype),
                    preferred_element_type=jnp.float32)


def _project_forward(x_BxTxD, weights, weights_spec, compute_dtype):
  return (_project(x_BxTxD, weights, weights_spec, compute_dtype),
          (x_BxTxD, weights))


def project_gradients(x_BxTxD: Array, weights: Array, weights_spec: str,
                      compute_dtype, d_logits_BxTxV: Array
                      ) -> tuple[Array, Array]:
  """The gradients (x's, in its dtype; the weights', in theirs) of
  `project`'s logits given their float32 cotangent: operands in
  `compute_dtype`, accumulation in float32."""
  # The float32 cotangent is rounded to the compute dtype once, so that the
  # two gradient matmuls run at its speed; both accumulate in float32, and
  # the weights' gradient stays float32 (summed over blocks of tokens).
  d_BxTxV = d_logits_BxTxV.astype(compute_dtype)
  d_x = jnp.einsum(f'btv,{weights_spec}->btd', d_BxTxV,
                   weights.astype(compute_dtype),
                   preferred_element_type=jnp.float32)
  d_weights = jnp.einsum(f'btv,btd->{weights_spec}', d_BxTxV,
                         x_BxTxD.astype(compute_dtype),
                         preferred_element_type=jnp.float32)
  return d_x.astype(x_BxTxD.dtype), d_weights.astype(weights.dtype)


def _project_backward(weights_spec, compute_dtype, residuals,
                      d_logits_BxTxV):
  x_BxTxD, weights = residuals
  return project_gradients(x_BxTxD, weights, weights_spec, compute_dtype,
                           d_logits_BxTxV)


_project.defvjp(_project_forward, _project_backward)


def project(x_BxTxD: Array, weights: Array, weights_spec: str,
            compute_dtype) -> Array:
  """Logits x W, float32 [B, T, V], of weights [V, D] ('vd') or [D, V]
  ('dv'): operands (and the gradients' operands) in `compute_dtype`,
  accumulation in float32. In float32, plain autodiff."""
  if jnp.dtype(compute_dtype) == jnp.float32:
    return jnp.einsum(f'btd,{weights_spec}->btv',
                      x_BxTxD.astype(jnp.float32),
                      weights.astype(jnp.float32))
  return _project(x_BxTxD, weights, weights_spec, jnp.dtype(compute_dtype))


@flax.struct.dataclass
class Readout:
  """logits = softcap(project(hidden, weights) / divisor + bias, cap),
  float32 [B, T, V].

  `weights` and `bias_V` are the parameters as stored (float32 when the
  weights are): a token embedding [V, D] (`weights_spec` 'vd') or a
  kernel [D, V] ('dv'); `divisor` is sqrt(d_model) for an output
  projection tied to unit-variance embeddings, else 1; `cap` the logits'
  tanh cap (config.model.logit_softcap), 0 for none.
  """

  hidden_BxTxD: Array
  weights: Array
  bias_V: Array | None = None
  weights_spec: str = flax.struct.field(pytree_node=False, default='dv')
  divisor: float = flax.struct.field(pytree_node=False, default=1.0)
  compute_dtype: jnp.dtype = flax.struct.field(pytree_node=False,
                                               default=jnp.float32)
  cap: float = flax.struct.field(pytree_node=False, default=0.0)

  @property
  def vocab_size(self) -> int:
    return self.weights.shape[self.weights_spec.index('v')]

  def logits(self, hidden_BxTxD: Array | None = None) -> Array:
    """The logits of `hidden_BxTxD` (default: all of `self.hidden_BxTxD`),
    float32 [B, T, V]."""
    hidden = self.hidden_BxTxD if hidden_BxTxD is None else hidden_BxTxD
    logits_BxTxV = project(hidden, self.weights, self.weights_spec,
                           self.compute_dtype)
    if self.divisor != 1.0:
      logits_BxTxV = logits_BxTxV / self.divisor
    if self.bias_V is not None:
      logits_BxTxV = logits_BxTxV + self.bias_V.astype(jnp.float32)
    return softcap(logits_BxTxV, self.cap)
