"""Every attention variant stays finite, with its gradients, where softmax
attention is easy to break: logits of +-1e4, bfloat16 inputs 4096 tokens
long, and query rows whose every key is masked."""

import chex
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
import numpy as np
import pytest

from model import attention
from tests.helpers.distinct_variants import distinct_variants
from tests.helpers.owned_parameters import owned

B, N, H = 2, 2, 8


def parameters(name: str, batch: int, heads: int, length: int,
               dtype) -> dict:
  """The arrays a parameter-owning variant takes as options (what
  Variant.parameters would pass, and the layer's input where it reads
  it), and small block sizes."""
  rng = jax.random.split(jax.random.key(7), 3)
  if attention.spec(name).reads_inputs:
    owned_kwargs, _ = owned(name, d_model=heads * H, num_heads=heads,
                            num_kv_heads=heads)
    return owned_kwargs | {'inputs': jax.random.normal(
        rng[0], (batch, length, heads * H), dtype)}
  if name == 'linformer':
    projection = jax.random.normal(rng[0], (16, length), dtype) / length**0.5
    return dict(key_projection=projection, value_projection=projection)
  if name == 'additive':  # A hidden width of 2: its [T, S, A] is large.
    return dict(query_weight=jax.random.normal(rng[0], (heads, H, 2), dtype),
                key_weight=jax.random.normal(rng[1], (heads, H, 2), dtype),
                score_weight=jax.random.normal(rng[2], (heads, 2), dtype))
  if name == 'hedgehog':
    return dict(feature_map=jax.random.normal(rng[0], (heads, H, H), dtype)
                / H**0.5)
  if name == 'memory_compressed':  # Each window about a mean of its keys.
    kernel = jax.random.normal(rng[0], (3, heads, H, heads, H), dtype) / (
        3 * heads * H)**0.5
    return dict(key_kernel=kernel, value_kernel=kernel)
  return {'chunked': dict(chunk_size=256), 'local': dict(window=64),
          'strided': dict(stride=64), 'fixed': dict(block=64, summary=4),
          'bigbird': dict(block=64), 'performer': dict(num_features=32),
          }.get(name, {})


def run(name: str, q, k, v, mask=None):
  """Output and (q, k, v) gradients of a nonlinear loss, causal where the
  variant can be, from one compiled program; jitted on an 8-device
  sequence mesh for ring."""
  causal = attention.spec(name).causal
  options = parameters(name, q.shape[0], q.shape[2], k.shape[1], q.dtype)
  fn = attention.get(name)

  def loss(q, k, v):
    out = fn(q, k, v, mask=mask, is_causal=causal, **options)
    return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

  with jax.set_mesh(jax.make_mesh((8,), ('sequence',),
                                  axis_types=(AxisType.Auto,))):
    (_, output), grads = jax.jit(jax.value_and_grad(
        loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return output, grads


def named(output, grads):
  """The output and the gradients w.r.t. q, k, v by name, which chex says
  of the one that is not finite."""
  return {'output': output} | {f'grad_{name}': grad
                               for name, grad in zip('qkv', grads)}


@pytest.mark.parametrize('name', distinct_variants())
def test_bfloat16_at_4096_tokens_gives_finite_outputs_and_gradients(name):
  q, k, v = (jax.random.normal(key, (1, 4096, 1, H), jnp.bfloat16)
             for key in jax.random.split(jax.random.key(2), 3))
  output, grads = run(name, q, k, v)
  assert output.dtype == jnp.bfloat16
  chex.assert_tree_all_finite(named(output, grads))


@pytest.mark.core
@pytest.mark.parametrize('name', distinct_variants())
def test_logits_of_1e4_and_fully_masked_rows_stay_finite_and_rows_zero(name):
  """One program each: logits of +-1e4 (q . k / sqrt(H) = +-1e4 where all
  signs agree, every value between), and rows whose every key is masked,
  which come out zero."""
  length = 64
  signs = jnp.sign(jax.random.normal(jax.random.key(0), (2, B, length, N, H)))
  size = (1e4 * H**0.5 / H)**0.5
  q, k = size * signs[0], size * signs[1]
  v = jax.random.normal(jax.random.key(1), (B, length, N, H))
  assert float(jnp.max(jnp.einsum('bqnh,bknh->bnqk', q, k))) / H**0.5 == (
      pytest.approx(1e4))
  if attention.spec(name).masks == 'any':
    mask = np.ones((B, 1, length, length), bool)
    mask[1, :, 5:20] = False  # Queries 5..19 of example 1 see no key.
    empty = (1, slice(5, 20))
  else:  # Key padding only: example 1 has no real key at all.
    mask = np.ones((B, 1, 1, length), bool)
    mask[1] = False
    empty = (1, slice(None))
  output, grads = run(name, q, k, v, jnp.asarray(mask))
  chex.assert_tree_all_finite(named(output, grads))
  np.testing.assert_array_equal(output[empty], 0.0)
