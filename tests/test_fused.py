"""The fused attention kernels against dense, on the CPU: the Pallas
kernels interpreted, cuDNN's call through XLA's implementation of the same
function; and the table that chooses among them."""

from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention
from model.attention import fused, fused_kernels
from model.attention.fused import Case

B, N, H = 2, 4, 16
dense = attention.scaled_dot_product_attention


def make_qkv(seed, length, num_kv_heads):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (B, length, N, H)),
          jax.random.normal(kk, (B, length, num_kv_heads, H)),
          jax.random.normal(kv, (B, length, num_kv_heads, H)))


def window_mask(length, window, is_causal):
  """local's pattern as a [1, 1, T, T] mask for dense."""
  offsets = np.arange(length)[:, None] - np.arange(length)[None]
  allowed = (offsets < window) & (offsets >= 0 if is_causal
                                  else offsets > -window)
  return jnp.asarray(allowed)[None, None]


def value_and_grads(fn, q, k, v, **kwargs):
  """The output, and the gradients w.r.t. q, k, v of a nonlinear loss."""
  def loss(q, k, v):
    out = fn(q, k, v, **kwargs)
    return jnp.sum(jnp.sin(out)), out
  (_, out), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return (out,) + grads


def assert_all_close(ours, reference, atol=2e-5):
  for x, y in zip(ours, reference):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol,
                               rtol=1e-4)


PACKED = np.repeat(np.array([[1, 2, 3, 0], [4, 4, 5, 0]]), [60, 70, 50, 20],
                   axis=1)
LENGTHS = np.array([72, 0])  # Example 1 is all padding.

# name: (length, key/value heads, kernels, chunked's arguments, dense's).
CASES = {
    # Causal packed rows, GQA, 200 = no multiple of the blocks.
    'causal_packed_gqa': (200, 2, ('pallas_tpu', 'pallas_gpu'), dict(
        is_causal=True, mask=attention.SegmentMask(jnp.asarray(PACKED))),
                          dict(is_causal=True, mask=jnp.asarray(
                              PACKED[:, None, :, None]
                              == PACKED[:, None, None, :]))),
    'bidirectional_mqa': (72, 1, ('pallas_tpu', 'pallas_gpu'), {}, {}),
    'right_padded_mqa': (
        72, 1, ('pallas_tpu',),
        dict(mask=jnp.asarray(np.arange(72) < LENGTHS[:, None])[
            :, None, None]), None),
}


@pytest.mark.parametrize('kernel,name', [
    (kernel, name) for name, case in CASES.items() for kernel in case[2]])
def test_pallas_kernels_equal_dense(kernel, name):
  length, num_kv_heads, _, ours, reference = CASES[name]
  q, k, v = make_qkv(len(name), length, num_kv_heads)
  chunked = attention.get('chunked')
  assert_all_close(
      value_and_grads(chunked, q, k, v, kernel=kernel, **ours),
      value_and_grads(dense, q, k, v, **ours if reference is None
                      else reference))


@pytest.mark.parametrize('is_causal', [True, False])
def test_splash_local_window_equals_dense(is_causal):
  """local's window on splash: GQA; under padding (bidirectional) a query
  whose window holds only padding comes out 0, as from dense."""
  q, k, v = make_qkv(7, 72, 2)
  window = 9
  mask = None
  if not is_causal:
    lengths = np.array([72, 30])
    mask = jnp.asarray(np.arange(72) < lengths[:, None])[:, None, None]
  expected = window_mask(72, window, is_causal)
  if mask is not None:
    expected = expected & mask
  local = attention.get('local')
  ours = value_and_grads(local, q, k, v, mask=mask, is_causal=is_causal,
                         window=window, kernel='pallas_tpu')
  assert_all_close(ours, value_and_grads(dense, q, k, v, mask=expected))
  if mask is not None:
    np.testing.assert_array_equal(ours[0][1, 30 + window:], 0.0)


def test_splash_runs_on_each_devices_share_of_the_batch():
  """Under a mesh whose 'data' axis splits the batch, splash runs in a
  shard_map (XLA cannot split a Pallas call) and still equals dense."""
  mesh = jax.make_mesh((8,), ('data',),
                       axis_types=(jax.sharding.AxisType.Auto,))
  q, k, v = (jnp.tile(x, (4, 1, 1, 1)) for x in make_qkv(10, 40, 2))
  ids = jnp.asarray(np.repeat([[1, 2]], 20, axis=1).repeat(4 * B, 0))
  kwargs = dict(is_causal=True, mask=attention.SegmentMask(ids))
  chunked = attention.get('chunked')
  with jax.set_mesh(mesh), nn.logical_axis_rules((('batch', 'data'),)):
    assert 'shard_map' in str(jax.make_jaxpr(
        lambda *x: chunked(*x, kernel='pallas_tpu', **kwargs))(q, k, v))
    ours = value_and_grads(chunked, q, k, v, kernel='pallas_tpu', **kwargs)
  assert_all_close(ours, value_and_grads(dense, q, k, v, **kwargs))


def test_cudnn_call_takes_right_padding_and_the_causal_window():
  """cuDNN's arguments, run by XLA's implementation of the same function:
  padding as lengths (a row of no keys gives 0), the causal window as a
  left window, a bias array; a row padded elsewhere than on the right
  comes out NaN."""
  q, k, v = make_qkv(8, 24, 2)
  lengths = np.array([17, 0])
  padding = jnp.asarray(np.arange(24) < lengths[:, None])[:, None, None]
  bias = jax.random.normal(jax.random.key(11), (1, N, 24, 24))
  cudnn = lambda q, k, v, bias=None, **kw: fused_kernels.cudnn_attention(
      q, k, v, bias, implementation='xla', scale=H ** -0.5, **kw)
  assert_all_close(
      value_and_grads(cudnn, q, k, v, mask=padding, is_causal=True,
                      window=None),
      value_and_grads(dense, q, k, v, mask=padding, is_causal=True))
  assert_all_close(
      value_and_grads(cudnn, q, k, v, bias=bias, mask=None, is_causal=True,
                      window=5),
      value_and_grads(dense, q, k, v, bias=bias,
                      mask=window_mask(24, 5, True)))
  holes = padding.at[0, 0, 0, 3].set(False)
  out = cudnn(q, k, v, mask=holes, is_causal=False, window=None)
  assert np.isnan(out[0]).all() and (out[1] == 0).all()


def test_rows_with_keys_match_brute_force():
  rng = np.random.default_rng(0)
  valid = rng.random((3, 11)) < 0.3
  for is_causal in (True, False):
    for window in (None, 1, 3):
      allowed = valid[:, None, :] & np.ones((11, 11), bool)
      offsets = np.arange(11)[:, None] - np.arange(11)[None]
      if is_causal:
        allowed &= offsets >= 0
      if window:
        allowed &= (offsets < window) & (offsets > -window)
      np.testing.assert_array_equal(
          fused_kernels.rows_with_keys(jnp.asarray(valid), 11,
                                       is_causal=is_causal, window=window),
          allowed.any(-1))


def case(backend, dtype='bfloat16', head_dim=64, q_len=256, kv_len=256,
         is_causal=True, **kwargs):
  return Case(backend, dtype, head_dim, q_len, kv_len, is_causal, **kwargs)


# (case, what 'auto' runs).
AUTO = [
    (case('cpu'), 'xla'),
    (case('cpu', mask='segments'), 'xla'),
    (case('tpu'), 'pallas_tpu'),
    (case('tpu', mask='segments'), 'pallas_tpu'),
    (case('tpu', mask='key_padding', is_causal=False), 'pallas_tpu'),
    (case('tpu', window=128), 'pallas_tpu'),
    (case('tpu', dtype='float32'), 'pallas_tpu'),
    (case('tpu', bias='function'), 'xla'),
    (case('tpu', mask='other'), 'xla'),
    (case('tpu', q_len=1, kv_len=256), 'xla'),  # A query after a cache.
    (case('gpu'), 'cudnn'),
    (case('gpu', mask='key_padding'), 'cudnn'),
    (case('gpu', bias='array'), 'cudnn'),
    (case('gpu', window=128), 'cudnn'),
    (case('gpu', mask='segments'), 'pallas_gpu'),
    (case('gpu', dtype='float32'), 'pallas_gpu'),
    (case('gpu', dtype='float32', mask='segments'), 'pallas_gpu'),
    (case('gpu', head_dim=160), 'xla'),
    (case('gpu', window=128, is_causal=False), 'xla'),
    (case('gpu', window=128, mask='key_padding'), 'xla'),
    (case('gpu', q_len=128, kv_len=256), 'xla'),  # Diagonal alignment.
    (case('gpu', is_causal=False, q_len=128, kv_len=256), 'cudnn'),
    (case('gpu', mask='other'), 'xla'),
    (case('gpu', bias='function'), 'xla'),
    (case('gpu', dtype='float32', mask='key_padding'), 'xla'),
    (case('gpu', dtype='bfloat16 queries, float32 keys'), 'xla'),
    (case('tpu', dtype='float16'), 'xla'),
]


@pytest.mark.parametrize('the_case,expected', AUTO)
def test_auto_chooses_by_backend_and_case(the_case, expected):
  assert fused.choose('auto', the_case) == expected
  # Every fused kernel it passed over refuses the case.
  for name in fused.AUTO_ORDER.get(the_case.backend, ()):
    if name == expected:
      break
    assert fused.refusal(name, the_case) is not None


def test_a_named_kernel_that_cannot_compute_the_case_raises():
  with pytest.raises(fused.KernelError, match="kernel='cudnn' needs a GPU"):
    fused.choose('cudnn', case('cpu'))
  with pytest.raises(fused.KernelError, match='takes no bias'):
    fused.choose('pallas_tpu', case('tpu', bias='array'))
  with pytest.raises(ValueError, match='must be one of'):
    fused.choose('flash', case('cpu'))
  q, k, v = make_qkv(9, 8, 2)
  with pytest.raises(fused.KernelError, match='needs a GPU'):
    attention.get('chunked')(q, k, v, kernel='cudnn')
  assert fused.choose('pallas_gpu', case('cpu')) == 'pallas_gpu'
