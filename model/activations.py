"""The feed-forward activations by name (config.model.mlp_activation), for
the dense MLP and the experts alike."""

from collections.abc import Callable
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def squared_relu(x: Array) -> Array:
  """relu(x)^2 (So et al. 2021, Primer)."""
  return jnp.square(nn.relu(x))


@dataclasses.dataclass(frozen=True)
class Activation:
  """An MLP's nonlinearity."""

  function: Callable[[Array], Array]
  # Gated (Shazeer 2020): function(x W_gate) * (x W), a second input
  # projection named `wi_gate` beside `wi`.
  gated: bool = False


ACTIVATIONS = {
    'relu': Activation(nn.relu),
    'relu2': Activation(squared_relu),
    'gelu': Activation(nn.gelu),
    'swiglu': Activation(nn.silu, gated=True),
}


def hidden(name: str, project: Callable[[str], Array]) -> Array:
  """The hidden units of an MLP with activation `name`; `project(param)`
  is the input projected by the weight named `param` ('wi', 'wi_gate')."""
  activation = ACTIVATIONS[name]
  if activation.gated:
    return activation.function(project('wi_gate')) * project('wi')
  return activation.function(project('wi'))
