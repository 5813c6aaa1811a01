"""The fused attention kernels against dense, on the CPU: the Pallas
kernels interpreted, cuDNN's call through XLA's implementation of the same
function; and the table that chooses among them."""

import chex
from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention, positions
from model.attention.core import logical_axes, patterns
from model.attention.kernels import (cudnn_packed, flex, flex_gpu, flex_tpu,
                                     fused, fused_kernels)
from model.attention.kernels.fused import Case
from model.attention.variants import sparse
from tests.helpers import tolerance
from tests.helpers.sparse_patterns import (bigbird_pattern, fixed_pattern,
                                           local_pattern, strided_pattern)

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
  chex.assert_trees_all_close(
      value_and_grads(chunked, q, k, v, kernel=kernel, **ours),
      value_and_grads(dense, q, k, v, **ours if reference is None
                      else reference), **tolerance.KERNEL)


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
  chex.assert_trees_all_close(
      ours, value_and_grads(dense, q, k, v, mask=expected), **tolerance.KERNEL)
  if mask is not None:
    np.testing.assert_array_equal(ours[0][1, 30 + window:], 0.0)


# --- block-sparse patterns: splash's block masks, the project's kernel ---

SEGMENTS = attention.SegmentMask(jnp.asarray(PACKED))
SAME_SEGMENT = PACKED[:, None, :, None] == PACKED[:, None, None, :]
# BigBird's random blocks for 200 positions in blocks of 16 (13 blocks).
RANDOM_BLOCKS = sparse.bigbird_random_blocks(13, 1, 2, seed=0)

# A key padding mask with holes: example 0 keeps keys 77 and 150 only,
# which many queries' patterns miss (dense gives those zeros), example 1
# a quarter of its keys.
HOLES = np.stack([np.isin(np.arange(200), [77, 150]),
                  np.random.default_rng(1).random(200) < 0.25])
# The rows' masks: (the variant's, dense's beside the pattern).
ROWS = {'plain': (None, True),
        'packed': (SEGMENTS, SAME_SEGMENT),
        'holes': (jnp.asarray(HOLES)[:, None, None], HOLES[:, None, None])}

# name: (variant, its options, its pattern [T, T], causal, rows, key/value
# heads, kernels). T = 200: no multiple of the kernels' tiles.
SPARSE_CASES = {
    'strided_causal_holes_gqa': (
        'strided', dict(stride=48), strided_pattern(200, 48, True), True,
        'holes', 2, ('pallas_tpu', 'pallas_gpu')),
    'fixed_bidirectional_holes_mqa': (
        'fixed', dict(block=32, summary=4), fixed_pattern(200, 32, 4, False),
        False, 'holes', 1, ('pallas_tpu', 'pallas_gpu')),
    'bigbird_causal_packed_gqa': (
        'bigbird', dict(block=16, num_random_blocks=2),
        bigbird_pattern(200, 16, 1, RANDOM_BLOCKS, True), True, 'packed', 2,
        ('pallas_tpu', 'pallas_gpu')),
    'bigbird_bidirectional_holes_mha': (
        'bigbird', dict(block=16, num_random_blocks=2),
        bigbird_pattern(200, 16, 1, RANDOM_BLOCKS, False), False, 'holes', 4,
        ('pallas_tpu', 'pallas_gpu')),
    # local's window on the GPU (splash's LocalMask is tested above).
    'local_bidirectional_packed_gqa': (
        'local', dict(window=40), local_pattern(200, 40, False), False,
        'packed', 2, ('pallas_gpu',)),
    'local_causal_holes_mqa': (
        'local', dict(window=40), local_pattern(200, 40, True), True,
        'holes', 1, ('pallas_gpu',)),
}


@pytest.mark.parametrize('kernel,name', [
    (kernel, name) for name, case in SPARSE_CASES.items()
    for kernel in case[-1]])
def test_block_sparse_kernels_equal_dense_under_the_pattern(kernel, name):
  """Outputs and q/k/v gradients of a block-sparse variant on a fused
  kernel equal dense's under the pattern's mask (and the rows' segments or
  key padding: a query that sees no key comes out 0, as from dense)."""
  variant, options, pattern, is_causal, rows, num_kv_heads, _ = (
      SPARSE_CASES[name])
  mask, rows_mask = ROWS[rows]
  q, k, v = make_qkv(len(name), 200, num_kv_heads)
  expected = jnp.asarray(pattern[None, None] & rows_mask)
  ours = value_and_grads(attention.get(variant), q, k, v, kernel=kernel,
                         is_causal=is_causal, mask=mask, **options)
  chex.assert_trees_all_close(
      ours, value_and_grads(dense, q, k, v, mask=expected), **tolerance.KERNEL)
  if rows == 'holes':  # Some queries of example 0 see no key.
    assert 0 < (~expected[0, 0].any(-1)).sum() < 200


def test_fused_kernels_split_batch_and_heads_as_the_rules_say():
  """Under a data x tensor mesh and rules mapping the model's batch and
  heads there, a fused kernel (cuDNN's call, by XLA's implementation) runs
  in a shard_map over both, its padding mask and bias split alike, and
  equals dense."""
  mesh = jax.make_mesh((4, 2), ('data', 'tensor'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = ((logical_axes.BATCH, 'data'), (logical_axes.HEADS, 'tensor'),
           (logical_axes.KV_HEADS, 'tensor'))
  q, k, v = (jnp.tile(x, (2, 1, 1, 1)) for x in make_qkv(10, 24, 2))
  padding = jnp.asarray(np.arange(24) < np.array([24, 17, 0, 9])[:, None])
  bias = jax.random.normal(jax.random.key(3), (1, N, 24, 24))
  kwargs = dict(mask=padding[:, None, None], bias=bias, is_causal=True)
  cudnn = lambda q, k, v, bias, mask, is_causal: fused_kernels.over_shards(
      lambda q, k, v, bias, mask, sinks, _: fused_kernels.cudnn_attention(
          q, k, v, bias, mask, scale=H ** -0.5, is_causal=is_causal,
          window=None, sinks=sinks, implementation='xla'), q, k, v, bias,
      mask)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    jaxpr = str(jax.make_jaxpr(lambda *x: cudnn(*x, **kwargs))(q, k, v))
    ours = value_and_grads(cudnn, q, k, v, **kwargs)
  assert "in_specs=(P('data', None, 'tensor'), " in jaxpr
  chex.assert_trees_all_close(
      ours, value_and_grads(dense, q, k, v, **kwargs), **tolerance.KERNEL)


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
  chex.assert_trees_all_close(
      value_and_grads(cudnn, q, k, v, mask=padding, is_causal=True,
                      window=None),
      value_and_grads(dense, q, k, v, mask=padding, is_causal=True),
      **tolerance.KERNEL)
  chex.assert_trees_all_close(
      value_and_grads(cudnn, q, k, v, bias=bias, mask=None, is_causal=True,
                      window=5),
      value_and_grads(dense, q, k, v, bias=bias,
                      mask=window_mask(24, 5, True)), **tolerance.KERNEL)
  holes = padding.at[0, 0, 0, 3].set(False)
  out = cudnn(q, k, v, mask=holes, is_causal=False, window=None)
  assert np.isnan(out[0]).all() and (out[1] == 0).all()


@pytest.mark.core
@pytest.mark.parametrize('is_causal', [True, False])
def test_touched_tiles_match_brute_force(is_causal):
  """The tiles a kernel visits: those holding an allowed pair, for a
  pattern of k - q alone, one of whole tiles, and any other."""
  random_blocks = sparse.bigbird_random_blocks(12, 1, 2, seed=3)
  cases = [
      (patterns.Window(20), local_pattern(96, 20, is_causal)),
      (patterns.Strided(24), strided_pattern(96, 24, is_causal)),
      (patterns.Fixed(24, 3), fixed_pattern(96, 24, 3, is_causal)),
      (patterns.BigBird(16, 1, tuple(map(tuple, random_blocks.tolist()))),
       bigbird_pattern(96, 16, 1, random_blocks, is_causal))]
  for pattern, allowed in cases:
    for tile in (8, 16):
      np.testing.assert_array_equal(
          flex.touched_tiles(pattern, 96, tile, is_causal),
          allowed.reshape(96 // tile, tile, 96 // tile, tile).any((1, 3)),
          err_msg=f'{pattern}, tile {tile}')


@pytest.mark.core
def test_patterns_find_the_queries_that_see_a_key_under_padding():
  """sees_keys against the patterns written out, on rows with holes."""
  random_blocks = sparse.bigbird_random_blocks(7, 1, 1, seed=2)
  valid = np.random.default_rng(4).random((3, 100)) < 0.04
  for is_causal in (True, False):
    for pattern, allowed in [
        (patterns.Strided(12), strided_pattern(100, 12, is_causal)),
        (patterns.Fixed(16, 2), fixed_pattern(100, 16, 2, is_causal)),
        (patterns.BigBird(16, 1, tuple(map(tuple, random_blocks.tolist()))),
         bigbird_pattern(100, 16, 1, random_blocks, is_causal))]:
      expected = (allowed[None] & valid[:, None, :]).any(-1)
      assert 0 < expected.sum() < expected.size
      np.testing.assert_array_equal(
          pattern.sees_keys(jnp.asarray(valid), is_causal), expected,
          err_msg=f'{pattern}, causal {is_causal}')


@pytest.mark.core
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


# --- ALiBi's bias inside the kernel ---

ALIBI_IDS = np.repeat(np.array([[1, 2, 0], [3, 3, 4]]), [15, 20, 5], axis=1)
ALIBI_POSITIONS = np.concatenate(
    [np.arange(15), np.arange(20), np.arange(5)])[None].repeat(B, 0)

# name: (key/value heads, causal, mask, positions, dtype, tolerance).
ALIBI_CASES = {
    # Packed rows (positions from each document's start), GQA.
    'causal_packed_gqa': (2, True, attention.SegmentMask(
        jnp.asarray(ALIBI_IDS)), ALIBI_POSITIONS, jnp.float32,
                          tolerance.KERNEL),
}


@pytest.mark.parametrize('name', ALIBI_CASES)
@pytest.mark.parametrize('kernel', ['pallas_gpu', 'pallas_tpu'])
def test_alibi_kernels_equal_dense_with_alibis_bias(kernel, name):
  """Through `chunked`'s kernel option, ALiBi's bias on the general kernel
  (test_flex.py checks it case by case): outputs and q/k/v gradients
  equal dense's under the same PositionBias."""
  num_kv_heads, is_causal, mask, positions_, dtype, tolerated = (
      ALIBI_CASES[name])
  q, k, v = (x.astype(dtype) for x in make_qkv(len(name), 40, num_kv_heads))
  positions_BxT = jnp.broadcast_to(jnp.asarray(positions_), (B, 40))
  bias = positions.alibi_bias(positions_BxT, positions_BxT, N)
  kwargs = dict(bias=bias, mask=mask, is_causal=is_causal)
  chunked = attention.get('chunked')
  ours = value_and_grads(chunked, q, k, v, kernel=kernel, **kwargs)
  reference = value_and_grads(dense, q, k, v, **kwargs)
  chex.assert_trees_all_close([x.astype(jnp.float32) for x in ours],
                              [x.astype(jnp.float32) for x in reference],
                              **tolerated)
  if mask is not None and not is_causal:
    np.testing.assert_array_equal(ours[0][1], 0.0)


ALIBI_BIAS = positions.alibi_bias(jnp.asarray(ALIBI_POSITIONS),
                                  jnp.asarray(ALIBI_POSITIONS), N)


def alibi_call(attend):
  """The general kernel `attend` under ALiBi on ALIBI_POSITIONS, causal,
  given ids."""
  return lambda q, k, v, **ids: attend(q, k, v, score=ALIBI_BIAS, scale=0.25,
                                       is_causal=True, **ids)


# The kernels called directly with ids, (call, dense's bias, dense's mask
# beside the ids'): the general kernels under ALiBi's bias, the GPU's
# under a window of 8.
DIRECT_CALLS = {
    'flex_gpu': (alibi_call(flex_gpu.attention), ALIBI_BIAS, True),
    'flex_tpu': (alibi_call(flex_tpu.attention), ALIBI_BIAS, True),
    'flex_gpu_window': (lambda q, k, v, **ids: flex_gpu.attention(
        q, k, v, pattern=patterns.Window(8), scale=0.25, is_causal=True,
        **ids), None, window_mask(40, 8, True)),
}


@pytest.mark.parametrize('name', DIRECT_CALLS)
def test_kernels_refuse_key_ids_without_query_ids(name):
  """Ids of the keys alone say no mask (SegmentMask needs the queries'):
  refused, where the kernels dropped them and attended to every key."""
  q, k, v = make_qkv(0, 40, 2)
  with pytest.raises(ValueError, match='kv_ids_BxT without q_ids_BxT'):
    DIRECT_CALLS[name][0](q, k, v, kv_ids_BxT=jnp.asarray(ALIBI_IDS))


@pytest.mark.parametrize('name', DIRECT_CALLS)
def test_kernels_give_the_keys_the_query_ids_without_key_ids(name):
  """As SegmentMask without key ids: the keys are the queries' own
  positions, so their ids are the queries'."""
  call, bias, allowed = DIRECT_CALLS[name]
  q, k, v = make_qkv(0, 40, 2)
  ids = jnp.asarray(ALIBI_IDS)
  same_ids = ids[:, None, :, None] == ids[:, None, None, :]
  chex.assert_trees_all_close(
      call(q, k, v, q_ids_BxT=ids),
      dense(q, k, v, bias, allowed & same_ids, scale=0.25, is_causal=True),
      **tolerance.KERNEL)


def general_attention(attend, **kwargs):
  """The general kernel `attend` on packed rows whose positions are their
  ids, under T5's bias and a cap on the logits."""
  def call(q, k, v, ids_BxT):
    layer = positions.T5Bias(4, 8, 16, bidirectional=False)
    table = jnp.ones((8, 4)) / 8
    score = layer.apply({'params': {'embedding': table}}, ids_BxT, ids_BxT)
    return attend(q, k, v, score=score, scale=0.125, is_causal=True,
                  logit_cap=30.0, q_ids_BxT=ids_BxT, **kwargs)
  return call


def variant_attention(name, **options):
  """Variant `name` on packed rows."""
  return lambda q, k, v, ids_BxT: attention.get(name)(
      q, k, v, mask=attention.SegmentMask(ids_BxT), is_causal=True,
      **options)


TRITON, MOSAIC = '__gpu$xla.gpu.triton', 'tpu_custom_call'
# name: (backend, platform, the kernel's custom call, attention).
LOWERED = {
    't5_capped_triton': ('gpu', 'cuda', TRITON,
                         general_attention(flex_gpu.attention)),
    't5_capped_window_mosaic': ('tpu', 'tpu', MOSAIC, general_attention(
        flex_tpu.attention, pattern=patterns.Window(200))),
    # The general kernel, testing strided's pairs inside tiles.
    'strided_triton': ('gpu', 'cuda', TRITON,
                       variant_attention('strided', stride=48,
                                         kernel='pallas_gpu')),
    # Splash with BigBird's pattern as its block mask.
    'bigbird_splash': ('tpu', 'tpu', MOSAIC,
                       variant_attention('bigbird', block=64,
                                         kernel='pallas_tpu')),
}


@pytest.mark.parametrize('name', LOWERED)
def test_pallas_kernels_lower_for_their_accelerator(monkeypatch, name):
  """Exported for a GPU (Triton) or a TPU (Mosaic) from this CPU, not
  interpreted: the forward, dq and dk/dv kernels lower to three calls."""
  backend, platform, call, attend = LOWERED[name]
  monkeypatch.setattr(jax, 'default_backend', lambda: backend)
  shape = lambda *dims, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(dims, dtype)

  def loss(q, k, v, ids_BxT):
    return jnp.sum(attend(q, k, v, ids_BxT).astype(jnp.float32))

  exported = jax.export.export(
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(call)])(
          shape(1, 256, 4, 64), shape(1, 256, 2, 64), shape(1, 256, 2, 64),
          shape(1, 256, dtype=jnp.int32))
  assert exported.mlir_module().count(f'@{call}(') == 3


# --- packed rows in cuDNN's layout ---


def brute_force_layout(ids, max_segments):
  """(seqlen, offsets, fits) of one row of ids, by a loop over tokens."""
  runs = []  # [start, length, id]
  for t, token_id in enumerate(ids):
    if runs and runs[-1][2] == token_id:
      runs[-1][1] += 1
    else:
      runs.append([t, 1, token_id])
  fits = (len(runs) <= max_segments
          and len({r[2] for r in runs}) == len(runs))
  kept = runs[:max_segments]
  seqlen = [r[1] for r in kept] + [-1] * (max_segments - len(kept))
  offsets = [r[0] for r in kept] + [-1] * (max_segments + 1 - len(kept))
  return seqlen, offsets, fits


SEGMENT_ROWS = np.array([
    [5] * 12,                                   # One segment.
    [1, 1, 2, 2, 2, 3, 4, 4, 5, 6, 6, 6],       # The most segments: 6.
    [1, 1, 1, 2, 2, 2, 2, 2, 0, 0, 0, 0],       # Trailing padding.
    [1, 1, 2, 2, 1, 1, 3, 3, 3, 3, 3, 3],       # An id comes back.
    [1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 7, 7],       # Seven: over the bound.
])


def test_segment_layout_matches_brute_force():
  seqlen, offsets, fits = cudnn_packed.segment_layout(
      jnp.asarray(SEGMENT_ROWS), 6)
  for row, ids in enumerate(SEGMENT_ROWS):
    want = brute_force_layout(ids.tolist(), 6)
    np.testing.assert_array_equal(seqlen[row], want[0])
    if want[2]:  # A row that does not fit is NaN: its offsets are moot.
      np.testing.assert_array_equal(offsets[row], want[1])
    assert bool(fits[row]) == want[2], row


def cudnn_reference(query, key, value, seqlen, offsets, *, scale, is_causal):
  """Attention from the packed layout as cuDNN's documentation defines it:
  a token of segment m (offsets[m] <= t < offsets[m] + seqlen[m]) attends
  to the tokens of its own segment (under causality, up to itself)."""
  positions = np.arange(query.shape[1])
  starts, lengths = offsets[:, None, :-1], seqlen[:, None, :]
  member_BxTxM = ((positions[None, :, None] >= starts)
                  & (positions[None, :, None] < starts + lengths)
                  & (lengths > 0))
  same = jnp.einsum('btm,bsm->bts', member_BxTxM.astype(jnp.float32),
                    member_BxTxM.astype(jnp.float32)) > 0
  return dense(query, key, value, mask=same[:, None], scale=scale,
               is_causal=is_causal)


@pytest.mark.parametrize('is_causal', [True, False])
@pytest.mark.parametrize('num_kv_heads', [4, 2, 1], ids=['mha', 'gqa', 'mqa'])
def test_cudnn_packed_layout_equals_dense_with_segment_ids(num_kv_heads,
                                                           is_causal):
  """The layout through the reference equals dense with the SegmentMask
  (outputs and gradients); rows the layout cannot say come out NaN."""
  q, k, v = make_qkv(12, 12, num_kv_heads)
  ids = jnp.asarray(SEGMENT_ROWS[1:3])
  packed = lambda q, k, v: cudnn_packed.attention(
      q, k, v, ids, scale=H ** -0.5, is_causal=is_causal, max_segments=6,
      call=cudnn_reference)
  chex.assert_trees_all_close(
      value_and_grads(packed, q, k, v),
      value_and_grads(dense, q, k, v, mask=attention.SegmentMask(ids),
                      is_causal=is_causal), **tolerance.KERNEL)
  # And the reference itself takes grouped key/value heads as they are.
  seqlen, offsets, _ = cudnn_packed.segment_layout(ids, 6)
  np.testing.assert_allclose(
      cudnn_reference(q, k, v, seqlen, offsets, scale=H ** -0.5,
                      is_causal=is_causal),
      dense(q, k, v, mask=attention.SegmentMask(ids), is_causal=is_causal),
      atol=2e-5)
  bad = cudnn_packed.attention(
      q, k, v, jnp.asarray(SEGMENT_ROWS[3:]), scale=H ** -0.5,
      is_causal=is_causal, max_segments=6, call=cudnn_reference)
  assert np.isnan(bad).all()


def test_packed_rows_need_a_known_jax_and_cudnn_96(monkeypatch):
  hopper = dict(mask='segments', compute_capability='9.0', max_segments=9)
  monkeypatch.setattr(cudnn_packed, '_cudnn_version', lambda: 90100)
  with pytest.raises(fused.KernelError, match='cuDNN 9.6 or newer, not 90100'):
    fused.choose('cudnn', case('gpu', **hopper))
  assert fused.choose('auto', case('gpu', **hopper)) == 'pallas_gpu'
  monkeypatch.setattr(cudnn_packed, '_cudnn_version', lambda: 90600)
  monkeypatch.setattr(cudnn_packed, '_jax_version', lambda: (0, 12, 0))
  with pytest.raises(fused.KernelError, match='jax 0.5.1 to 0.11.2'):
    fused.choose('cudnn', case('gpu', **hopper))


def case(backend, dtype='bfloat16', head_dim=64, q_len=256, kv_len=256,
         is_causal=True, **kwargs):
  return Case(backend, dtype, head_dim, q_len, kv_len, is_causal, **kwargs)


STRIDED = patterns.Strided(64)
# A score function of the queries (Shaw's), which the kernels leave to xla.
SHAW = 'computes no score function of the queries or keys'
bigbird = lambda block: patterns.BigBird(block, 1, ((-1,),) * 4)

# (case, what 'auto' runs).
AUTO = [
    (case('cpu'), 'xla'),
    (case('cpu', mask='segments'), 'xla'),
    (case('tpu'), 'pallas_tpu'),
    (case('tpu', mask='segments'), 'pallas_tpu'),
    (case('tpu', mask='key_padding', is_causal=False), 'pallas_tpu'),
    (case('tpu', window=128), 'pallas_tpu'),
    (case('tpu', dtype='float32'), 'pallas_tpu'),
    (case('tpu', bias='function'), 'pallas_tpu'),
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
    # A bidirectional window: the project's block-sparse kernel.
    (case('gpu', window=128, is_causal=False), 'pallas_gpu'),
    (case('gpu', window=128, is_causal=False, head_dim=96), 'xla'),
    (case('gpu', window=128, mask='key_padding'), 'pallas_gpu'),
    (case('gpu', q_len=128, kv_len=256), 'xla'),  # Diagonal alignment.
    (case('gpu', is_causal=False, q_len=128, kv_len=256), 'cudnn'),
    (case('gpu', mask='other'), 'xla'),
    (case('gpu', bias='function'), 'pallas_gpu'),
    (case('gpu', dtype='float32', mask='key_padding'), 'pallas_gpu'),
    (case('gpu', dtype='bfloat16 queries, float32 keys'), 'xla'),
    (case('tpu', dtype='float16'), 'xla'),
    # Packed rows: cuDNN's packed layout on Hopper and newer, bounded rows.
    (case('gpu', mask='segments', compute_capability='9.0',
          max_segments=33), 'cudnn'),
    (case('gpu', mask='segments', compute_capability='10.0',
          max_segments=33), 'cudnn'),
    (case('gpu', mask='segments', compute_capability='8.0',
          max_segments=33), 'pallas_gpu'),
    (case('gpu', mask='segments', compute_capability='9.0'), 'pallas_gpu'),
    (case('gpu', dtype='float32', mask='segments', compute_capability='9.0',
          max_segments=33), 'pallas_gpu'),
    # A score function (ALiBi's, T5's bias): the general kernel on both,
    # with a window or a pattern too; one of the queries or keys on xla.
    (case('gpu', bias='function', mask='segments', compute_capability='9.0',
          max_segments=33), 'pallas_gpu'),
    (case('gpu', bias='function', mask='key_padding', is_causal=False),
     'pallas_gpu'),
    (case('gpu', bias='function', head_dim=96), 'xla'),
    (case('gpu', bias='function', window=64), 'pallas_gpu'),
    (case('gpu', bias='function', q_len=1), 'xla'),
    (case('gpu', bias='function', score_refusal=SHAW), 'xla'),
    (case('tpu', bias='function', mask='segments'), 'pallas_tpu'),
    (case('tpu', bias='function', head_dim=96), 'xla'),
    (case('tpu', bias='function', window=64), 'pallas_tpu'),
    (case('tpu', bias='function', pattern=bigbird(256)), 'pallas_tpu'),
    (case('tpu', bias='function', pattern=bigbird(64)), 'xla'),
    (case('tpu', bias='function', score_refusal=SHAW), 'xla'),
    # Block-sparse patterns: splash's block masks, the project's kernel
    # (BigBird's block its tile), never cuDNN; strided's and fixed's, whose
    # columns reach nearly every tile, on xla.
    (case('tpu', pattern=bigbird(64), mask='segments'), 'pallas_tpu'),
    (case('tpu', pattern=bigbird(64), mask='key_padding'), 'pallas_tpu'),
    (case('gpu', pattern=bigbird(64), mask='key_padding'), 'pallas_gpu'),
    (case('gpu', pattern=bigbird(64), mask='other'), 'xla'),
    (case('gpu', pattern=bigbird(64)), 'pallas_gpu'),
    (case('gpu', pattern=bigbird(64), mask='segments',
          compute_capability='9.0', max_segments=33), 'pallas_gpu'),
    (case('gpu', pattern=bigbird(48)), 'xla'),
    (case('gpu', pattern=bigbird(64), head_dim=96), 'xla'),
    (case('tpu', pattern=STRIDED), 'xla'),
    (case('gpu', pattern=patterns.Fixed(64, 8), mask='segments'), 'xla'),
    # A length split over the mesh: no fused kernel (ring computes it).
    (case('tpu', length_shards=2), 'xla'),
    (case('gpu', length_shards=4), 'xla'),
    # Capped attention logits: the general kernel's.
    (case('tpu', logit_cap=30.0), 'pallas_tpu'),
    (case('gpu', logit_cap=30.0), 'pallas_gpu'),
]


@pytest.mark.parametrize('the_case,expected', AUTO)
def test_auto_chooses_by_backend_and_case(the_case, expected):
  assert fused.choose('auto', the_case) == expected
  if not getattr(the_case.pattern, 'in_tiles', True):
    return  # Left to xla, though a kernel named computes it.
  # Every fused kernel it passed over refuses the case.
  for name in fused.AUTO_ORDER.get(the_case.backend, ()):
    if name == expected:
      break
    assert fused.refusal(name, the_case) is not None


@pytest.mark.core
def test_a_named_kernel_that_cannot_compute_the_case_raises():
  with pytest.raises(fused.KernelError, match="kernel='cudnn' needs a GPU"):
    fused.choose('cudnn', case('cpu'))
  with pytest.raises(fused.KernelError, match='takes no bias'):
    fused.choose('pallas_tpu', case('tpu', bias='array'))
  with pytest.raises(fused.KernelError, match='Hopper or newer'):
    fused.choose('cudnn', case('gpu', mask='segments',
                               compute_capability='8.6', max_segments=9))
  with pytest.raises(fused.KernelError, match='sequence parallelism'):
    fused.choose('pallas_tpu', case('tpu', length_shards=2))
  with pytest.raises(fused.KernelError, match='no cap on the attention'):
    fused.choose('cudnn', case('gpu', logit_cap=30.0))
  with pytest.raises(ValueError, match='must be one of'):
    fused.choose('flash', case('cpu'))
  with pytest.raises(fused.KernelError, match='no block-sparse pattern'):
    fused.choose('cudnn', case('gpu', pattern=STRIDED))
  with pytest.raises(fused.KernelError, match='no score function of the'):
    fused.choose('pallas_gpu', case('gpu', bias='function',
                                    score_refusal=SHAW))
  q, k, v = make_qkv(9, 8, 2)
  with pytest.raises(fused.KernelError, match='needs a GPU'):
    attention.get('chunked')(q, k, v, kernel='cudnn')
  with pytest.raises(fused.KernelError,
                     match="bigbird's block as its tile: 16, 32, 64, 128 or "
                           'a multiple of 128, not 2'):
    attention.get('bigbird')(q, k, v, kernel='pallas_gpu', block=2)
  assert fused.choose('pallas_gpu', case('cpu')) == 'pallas_gpu'
  assert fused.choose('pallas_tpu', case('tpu', pattern=STRIDED)) == (
      'pallas_tpu')


@pytest.mark.core
def test_a_recording_keeps_each_choice_and_its_caller_and_raises_nothing():
  """Within fused.recording(), a trace learns what each call would run
  (train/config/kernels.py) while computing shapes with xla."""
  hopper = case('gpu', compute_capability='9.0')
  with fused.recording() as decisions:
    with fused.caller(('decoder', 'block_1', 'self_attention')):
      assert fused.choose('auto', hopper) == 'xla'
    assert fused.choose('cudnn', case('cpu')) == 'xla'
  assert [(d.caller, d.option, d.kernel) for d in decisions] == [
      (('decoder', 'block_1', 'self_attention'), 'auto', 'cudnn'),
      ((), 'cudnn', None)]
  assert decisions[0].refusal is None
  assert decisions[1].refusal.startswith('needs a GPU')
  # Outside a recording, the same calls run and refuse as ever.
  assert fused.choose('auto', hopper) == 'cudnn'
  with pytest.raises(fused.KernelError, match='needs a GPU'):
    fused.choose('cudnn', case('cpu'))
