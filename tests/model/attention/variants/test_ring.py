"""Ring attention (model/attention/variants/ring.py) over a mesh's sequence
axis: exact against dense, with biases, segment ids and gradients."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from configs import default
from model import attention, positions
from tests.helpers import tolerance
from train.program import mesh


def random_qkv(batch=2, length=16, heads=4, kv_heads=2, head_dim=8):
  rng = np.random.default_rng(1)
  make = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return (make(batch, length, heads, head_dim),
          make(batch, length, kv_heads, head_dim),
          make(batch, length, kv_heads, head_dim))


def ring_mesh(**sizes):
  config = default.get_config()
  config.parallelism.update(dict(data=1) | sizes)
  return mesh.make_mesh(config.parallelism)


RING_CASES = {
    'plain': dict(),
    'causal': dict(is_causal=True),
    'padding_mask': dict(mask=jnp.arange(16)[None, None, None, :] < 13),
    'row_mask_and_bias': dict(
        mask=jnp.asarray(np.random.default_rng(2).random((2, 1, 16, 16))
                         > 0.3),
        bias=jnp.asarray(np.random.default_rng(3).normal(size=(2, 4, 16, 16)),
                         jnp.float32), is_causal=True),
}


@pytest.mark.parametrize('case', RING_CASES)
@pytest.mark.parametrize('sizes', [dict(sequence=8),
                                   dict(data=2, sequence=4)],
                         ids=['sequence8', 'data2_sequence4'])
def test_ring_attention_equals_dense_with_gradients(case, sizes):
  q, k, v = random_qkv()
  kwargs = RING_CASES[case]

  def loss(fn, q, k, v):
    return jnp.sum(jnp.sin(fn(q, k, v, **kwargs)))

  dense = attention.get('dense')
  expected, expected_grads = jax.jit(lambda *a: (
      dense(*a, **kwargs),
      jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(*a)))(q, k, v)
  ring = attention.get('ring')
  with jax.set_mesh(ring_mesh(**sizes)):
    # One compilation for the outputs and the gradients.
    out, grads = jax.jit(lambda *a: (
        ring(*a, **kwargs),
        jax.grad(lambda *a: loss(ring, *a), argnums=(0, 1, 2))(*a)))(q, k, v)
  chex.assert_trees_all_close((out, grads), (expected, expected_grads),
                              **tolerance.FLOAT32)


@pytest.mark.core
def test_ring_attention_passes_blocks_round_the_ring():
  q, k, v = random_qkv()
  ring = attention.get('ring')
  with jax.set_mesh(ring_mesh(sequence=8)):
    hlo = jax.jit(lambda q, k, v: ring(q, k, v, is_causal=True)).lower(
        q, k, v).compile().as_text()
  assert 'collective-permute' in hlo
  # Sequence-split: no device computes logits for the whole length.
  assert 'f32[2,2,2,16,16]' not in hlo


def test_ring_attention_with_a_position_bias_and_its_gradient():
  q, k, v = random_qkv()
  pos = jnp.tile(jnp.arange(16), (2, 1))
  slopes = jnp.asarray(positions.alibi_slopes(4), jnp.float32)

  def loss(fn, q, slopes):
    bias = positions.alibi_bias(pos, pos, 4)
    bias = dataclasses.replace(bias, data=bias.data | {'slopes': slopes})
    return jnp.sum(jnp.sin(fn(q, k, v, bias, is_causal=True)))

  want = jax.jit(jax.grad(lambda *a: loss(attention.get('dense'), *a),
                          argnums=(0, 1)))(q, slopes)
  with jax.set_mesh(ring_mesh(sequence=4, data=2)):
    got = jax.jit(jax.grad(lambda *a: loss(attention.get('ring'), *a),
                           argnums=(0, 1)))(q, slopes)
  chex.assert_trees_all_close(got, want, **tolerance.FLOAT32)


def test_ring_attention_with_segment_ids_and_its_gradients():
  """Packed rows under a sequence split: each device compares its queries'
  ids with every key's, and the result is dense's under the full mask."""
  q, k, v = random_qkv()
  ids = np.repeat([[1, 2, 3, 4], [1, 1, 2, 0]], 4, axis=1)
  ids[0, 5:9] = 7  # A sequence crossing the devices' blocks.
  full = jnp.asarray(ids[:, None, :, None] == ids[:, None, None, :])
  segments = attention.SegmentMask(jnp.asarray(ids), jnp.asarray(ids))

  def loss(fn, mask, q, k, v):
    return jnp.sum(jnp.sin(fn(q, k, v, mask=mask, is_causal=True)))

  want = jax.jit(jax.value_and_grad(
      lambda *a: loss(attention.get('dense'), full, *a), argnums=(0, 1, 2)))(
          q, k, v)
  with jax.set_mesh(ring_mesh(sequence=4, data=2)):
    got = jax.jit(jax.value_and_grad(
        lambda *a: loss(attention.get('ring'), segments, *a),
        argnums=(0, 1, 2)))(q, k, v)
  chex.assert_trees_all_close(got, want, **tolerance.FLOAT32)


@pytest.mark.parametrize('case', ['row_mask_and_bias', 'segment_ids'])
def test_ring_attention_under_explicit_mesh_axes(case):
  """A mesh of jax.make_mesh with Explicit axes, the inputs split by
  example: outputs and gradients (queries, keys, values, bias) equal
  dense's, and the output is split as the queries are."""
  q, k, v = random_qkv()
  if case == 'segment_ids':
    ids = jnp.asarray(np.repeat([[1, 2, 3, 4], [1, 1, 2, 0]], 4, axis=1))
    bias, ring_mask = None, attention.SegmentMask(ids, ids)
    dense_mask = ids[:, None, :, None] == ids[:, None, None, :]
  else:
    bias, ring_mask = (RING_CASES[case]['bias'], RING_CASES[case]['mask'])
    dense_mask = ring_mask

  def loss(fn, mask, *inputs):
    return jnp.sum(jnp.sin(fn(*inputs, mask=mask, is_causal=True)))

  want = jax.jit(jax.value_and_grad(
      lambda *a: loss(attention.get('dense'), dense_mask, *a),
      argnums=(0, 1, 2, 3)))(q, k, v, bias)
  explicit = jax.sharding.AxisType.Explicit
  mesh_2x4 = jax.make_mesh((2, 4), ('data', 'sequence'),
                           axis_types=(explicit, explicit))
  ring = attention.get('ring')
  with jax.set_mesh(mesh_2x4):
    q, k, v = (jax.device_put(x, jax.NamedSharding(mesh_2x4, P('data')))
               for x in (q, k, v))
    got = jax.jit(jax.value_and_grad(
        lambda *a: loss(ring, ring_mask, *a), argnums=(0, 1, 2, 3)))(
            q, k, v, bias)
    out = jax.eval_shape(lambda *a: ring(*a, mask=ring_mask, is_causal=True),
                         q, k, v, bias)
  chex.assert_trees_all_close(got, want, **tolerance.FLOAT32)
  assert out.sharding.spec == P('data', None, None, None)


def test_ring_attention_refuses_what_it_cannot_split():
  q, k, v = random_qkv(length=12)
  ring = attention.get('ring')
  with jax.set_mesh(ring_mesh(sequence=8)):
    with pytest.raises(ValueError, match='does not split evenly'):
      ring(q, k, v)
  with pytest.raises(ValueError, match='S == T'):
    ring(q, k[:, :8], v[:, :8])
