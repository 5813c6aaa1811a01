"""Attention sinks (config.model.attention_sinks; core.sink_softmax): a
learned logit per query head in each row's softmax normaliser, a key of
value zero. Each variant that takes them equals a float64 dense reference
over the pairs it sees with that extra column, outputs and gradients (the
sinks' included): on XLA, and on the general fused kernels, interpreted
(under a mesh that splits the batch and the heads, the sinks split with
the heads). cuDNN's kernel refuses them by name; a config asks for them
only of an attention whose weights are a softmax."""

import contextlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention
from model.attention.core import logical_axes
from model.attention.kernels import fused
from model.attention.variants import sparse
from model.config import ModelConfig
from model.families import check
from tests.helpers import sparse_patterns, tolerance
from tests.helpers.moba_choice import chosen_mask

B, T, N, K, H = 2, 12, 4, 2, 16
KEEP = np.arange(T) < np.array([[T], [9]])  # [B, T]: row 1 padded.
PADDING = jnp.asarray(KEEP[:, None, None, :])
CAUSAL = np.tril(np.ones((T, T), bool))


def inputs():
  """q [B, T, N, H], k and v [B, T, K, H], sinks [N], float32."""
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(B, T, heads, H)) for heads in (N, K, K))
  return tuple(jnp.asarray(x, jnp.float32)
               for x in (q, k, v, rng.normal(size=N) * 2))


def reference(q, k, v, sinks, allowed):
  """float64 softmax attention under `allowed` [B?, N?, T, T] with each
  head's sink as one more logit (value 0): written out as that column."""
  k, v = (jnp.repeat(x, N // K, axis=2) for x in (k, v))
  logits = jnp.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(H)
  logits = jnp.where(allowed, logits, -jnp.inf)
  column = jnp.broadcast_to(sinks[None, :, None, None], (B, N, T, 1))
  weights = jax.nn.softmax(jnp.concatenate([logits, column], -1))
  return jnp.einsum('bnts,bsnh->btnh', weights[..., :-1], v)


def loss_and_grads(fn, *args):
  """sum(sin(fn)) and its gradients in q, k, v and the sinks, compiled
  whole."""
  return jax.jit(jax.value_and_grad(lambda *x: jnp.sum(jnp.sin(fn(*x))),
                                    argnums=(0, 1, 2, 3)))(*args)


def bigbird_mask():
  randoms = sparse.bigbird_random_blocks(T // 3, 1, 1, seed=0)
  return sparse_patterns.bigbird_pattern(T, 3, 1, randoms, causal=False)


def moba_mask():
  q, k, _, _ = inputs()
  return chosen_mask(np.asarray(q, np.float64), np.asarray(k, np.float64),
                     KEEP, 4, 1, causal=True)


# name: (the call with sinks s, the pairs it sees as a function of nothing
# (some are costly), a kernel's mesh or None).
CASES = {
    'dense_causal_padded': (
        lambda q, k, v, s: attention.get('dense')(
            q, k, v, mask=PADDING, is_causal=True, sinks=s),
        lambda: CAUSAL & KEEP[:, None, None, :]),
    'chunked_chunks_of_5': (
        lambda q, k, v, s: attention.get('chunked')(
            q, k, v, mask=PADDING, is_causal=True, chunk_size=5,
            kernel='xla', sinks=s),
        lambda: CAUSAL & KEEP[:, None, None, :]),
    'local_causal': (
        lambda q, k, v, s: attention.get('local')(
            q, k, v, is_causal=True, window=4, kernel='xla', sinks=s),
        lambda: sparse_patterns.local_pattern(T, 4, causal=True)),
    'strided_padded': (
        lambda q, k, v, s: attention.get('strided')(
            q, k, v, mask=PADDING, stride=4, kernel='xla', sinks=s),
        lambda: sparse_patterns.strided_pattern(T, 4, causal=False)
        & KEEP[:, None, None, :]),
    'fixed_causal': (
        lambda q, k, v, s: attention.get('fixed')(
            q, k, v, is_causal=True, block=4, summary=2, kernel='xla',
            sinks=s),
        lambda: sparse_patterns.fixed_pattern(T, 4, 2, causal=True)),
    # Its global rows are dense's rows, the others gathered parts.
    'bigbird_global_rows': (
        lambda q, k, v, s: attention.get('bigbird')(
            q, k, v, block=3, num_global_blocks=1, num_random_blocks=1,
            kernel='xla', sinks=s),
        bigbird_mask),
    'moba_causal_padded': (
        lambda q, k, v, s: attention.get('moba')(
            q, k, v, mask=PADDING, is_causal=True, block_size=4, top_k=1,
            sinks=s),
        moba_mask),
    # The length over 4 devices: the sinks replicated into the ring.
    'ring_over_4': (
        lambda q, k, v, s: attention.get('ring')(
            q, k, v, is_causal=True, sinks=s),
        lambda: CAUSAL),
    # The general kernels (flex.py), under key padding as ids.
    'pallas_gpu_split_batch_and_heads': (
        lambda q, k, v, s: attention.get('chunked')(
            q, k, v, mask=PADDING, is_causal=True, kernel='pallas_gpu',
            sinks=s),
        lambda: CAUSAL & KEEP[:, None, None, :]),
    'pallas_tpu': (
        lambda q, k, v, s: attention.get('chunked')(
            q, k, v, mask=PADDING, kernel='pallas_tpu', sinks=s),
        lambda: KEEP[:, None, None, :]),
}
RULES = ((logical_axes.BATCH, 'data'), (logical_axes.HEADS, 'tensor'),
         (logical_axes.KV_HEADS, 'tensor'))


@pytest.mark.parametrize('case', CASES)
def test_sinks_equal_the_dense_reference_with_an_extra_column(case):
  fn, allowed = CASES[case]
  args = inputs()
  with contextlib.ExitStack() as placed:
    if case.startswith('ring'):
      placed.enter_context(jax.set_mesh(jax.make_mesh(
          (4,), ('sequence',), axis_types=(jax.sharding.AxisType.Auto,))))
    elif case.startswith('pallas_gpu'):
      placed.enter_context(jax.set_mesh(jax.make_mesh(
          (2, 2), ('data', 'tensor'),
          axis_types=(jax.sharding.AxisType.Auto,) * 2)))
      placed.enter_context(nn.logical_axis_rules(RULES))
    got = loss_and_grads(fn, *args)
  pairs = allowed()
  with jax.enable_x64(True):
    want = loss_and_grads(
        lambda *x: reference(*x, jnp.asarray(pairs)),
        *(jnp.asarray(np.asarray(x), jnp.float64) for x in args))
  chex.assert_trees_all_close(
      got, jax.tree.map(lambda x: np.asarray(x, np.float32), want),
      **(tolerance.KERNEL if case.startswith('pallas')
         else tolerance.FLOAT32))


def test_cudnn_refuses_sinks_by_name_and_auto_takes_the_general_kernel():
  case = fused.Case('gpu', 'bfloat16', 64, 256, 256, True,
                    compute_capability='9.0', sinks=True)
  assert 'sinks' in fused.refusal('cudnn', case)
  assert fused.refusal('pallas_gpu', case) is None
  assert fused.choose('auto', case) == 'pallas_gpu'
  with pytest.raises(fused.KernelError, match='attention sinks'):
    fused.choose('cudnn', case)


def test_a_config_asks_for_sinks_only_of_an_attention_with_a_softmax():
  sinking = [name for name in attention.names()
             if attention.spec(name).sinks]
  assert {'dense', 'chunked', 'local', 'bigbird', 'ring', 'moba', 'mla',
          'additive', 'linformer'} <= set(sinking)
  assert not {'linear', 'performer', 'retnet', 'gla'} & set(sinking)
  with pytest.raises(ValueError, match='config.model.attention_sinks'):
    check(ModelConfig(attention='linear', attention_sinks=True))
  with pytest.raises(ValueError, match='attention_sinks'):
    ModelConfig(attention_projections=False, attention_sinks=True)
