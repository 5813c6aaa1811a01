"""The feed-forward activations against their formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import activations

X = np.linspace(-3.0, 3.0, 13, dtype=np.float32)
GATE = np.linspace(2.0, -1.0, 13, dtype=np.float32)
REFERENCES = {
    'relu': lambda x, gate: np.maximum(x, 0.0),
    'relu2': lambda x, gate: np.maximum(x, 0.0) ** 2,
    # flax's gelu: the tanh approximation (Hendrycks & Gimpel 2016).
    'gelu': lambda x, gate: 0.5 * x * (1 + np.tanh(
        np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
    # The gate through silu, times the other projection.
    'swiglu': lambda x, gate: gate / (1 + np.exp(-gate)) * x,
}


@pytest.mark.core
@pytest.mark.parametrize('name', sorted(activations.ACTIVATIONS))
def test_each_activation_is_its_formula(name):
  projected = {'wi': jnp.asarray(X), 'wi_gate': jnp.asarray(GATE)}
  np.testing.assert_allclose(
      activations.hidden(name, projected.__getitem__),
      REFERENCES[name](X, GATE), rtol=1e-6, atol=1e-6)


@pytest.mark.core
def test_squared_relu_has_the_gradient_of_its_formula():
  np.testing.assert_allclose(jax.vmap(jax.grad(activations.squared_relu))(X),
                             2 * np.maximum(X, 0.0), rtol=1e-6)
