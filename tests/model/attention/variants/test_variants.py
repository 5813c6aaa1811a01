"""Every attention variant against the dense reference it approximates or
equals, and the memory each needs."""

import functools
import types

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention
from model.attention.variants import chunk_plan, kernel, sparse
from tests.helpers import tolerance
from tests.helpers.compiled import compiled
from tests.helpers.distinct_variants import distinct_variants
from tests.helpers.sparse_patterns import (bigbird_pattern, fixed_pattern,
                                           local_pattern, strided_pattern)

B, T, N, H = 2, 10, 4, 8
dense = compiled(attention.scaled_dot_product_attention)


def variant(name: str):
  """The registered attention `name`, each call compiled whole."""
  return compiled(attention.get(name))


def make_qkv(seed, num_kv_heads=2, q_len=T, kv_len=T, scale=1.0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (scale * jax.random.normal(kq, (B, q_len, N, H)),
          scale * jax.random.normal(kk, (B, kv_len, num_kv_heads, H)),
          jax.random.normal(kv, (B, kv_len, num_kv_heads, H)))


def padding(kv_len=T, lengths=(T, 6)):
  """[B, 1, 1, S] key padding mask: example b has lengths[b] real keys."""
  return jnp.asarray(np.arange(kv_len)[None] < np.array(lengths)[:, None])[
      :, None, None, :]


def explicit(allowed: np.ndarray) -> jax.Array:
  """A [T, T] pattern as a [1, 1, T, T] mask for the dense reference."""
  return jnp.asarray(allowed)[None, None]


def grads(fn, q, k, v, bias=None, **kwargs):
  """Gradients of a nonlinear function of the output w.r.t. q, k, v (and
  bias when given)."""
  def loss(q, k, v, bias):
    return jnp.sum(jnp.sin(fn(q, k, v, bias, **kwargs)))
  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  return jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias)


@pytest.mark.core
def test_registry_lists_every_variant():
  assert attention.names() == sorted([
      'additive', 'bigbird', 'chunked', 'deltanet', 'dense', 'fixed',
      'gated_deltanet', 'gla', 'hedgehog', 'linear', 'linformer', 'local',
      'mamba2', 'memory_compressed', 'mla', 'moba', 'performer', 'retnet',
      'ring', 'strided'])
  assert attention.get('chunked') is attention.spec('chunked').fn


# --- chunked: exact ---

CHUNKED_CASES = {
    'plain': dict(),
    'causal': dict(is_causal=True),
    'padding_mask': dict(mask=padding()),
    'bias': dict(bias=jax.random.normal(jax.random.key(9), (1, N, T, T))),
    'mqa_causal_padding': dict(num_kv_heads=1, is_causal=True,
                               mask=padding()),
    'shorter_queries_causal': dict(q_len=4, is_causal=True),
    'longer_queries_causal': dict(q_len=13, is_causal=True),
    'bias_per_example_key': dict(
        bias=jax.random.normal(jax.random.key(10), (B, 1, 1, T))),
    'bias_per_head_query': dict(
        bias=jax.random.normal(jax.random.key(11), (1, N, T, 1))),
    # Packed rows; dense's SegmentMask is checked against an array below.
    'segments_causal': dict(is_causal=True, mask=attention.SegmentMask(
        *[jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0]] * B)] * 2)),
}


def chunked_case(name):
  """(q, k, v, bias, the other arguments) of CHUNKED_CASES[name]."""
  kwargs = dict(CHUNKED_CASES[name])
  q, k, v = make_qkv(0, kwargs.pop('num_kv_heads', 2),
                     q_len=kwargs.pop('q_len', T))
  return q, k, v, kwargs.pop('bias', None), kwargs


@functools.cache
def dense_of_chunked_case(name):
  """dense's output and gradients on CHUNKED_CASES[name], computed once
  for the three ways chunked is run on it."""
  q, k, v, bias, kwargs = chunked_case(name)
  return dense(q, k, v, bias, **kwargs), grads(dense, q, k, v, bias, **kwargs)


# The ways chunked runs: query blocks as the key chunks or of 3 (which
# the causal diagonal crosses), loops unrolled or lax loops. Causal and
# packed rows run each; the other cases one, in turn.
WAYS = [(None, 'unrolled'), (3, 'unrolled'), (3, 'looped')]
CHUNKED_RUNS = [
    (name, *way) for index, name in enumerate(CHUNKED_CASES)
    for way in (WAYS if name in ('causal', 'segments_causal')
                else [WAYS[index % len(WAYS)]])]


@pytest.mark.parametrize('name, query_chunk, loops', CHUNKED_RUNS)
def test_chunked_equals_dense_in_output_and_gradients(name, query_chunk,
                                                      loops, monkeypatch):
  if loops == 'looped':  # As long sequences run: lax loops over blocks.
    monkeypatch.setattr(chunk_plan, 'MAX_UNROLLED_BLOCKS', 0)
  q, k, v, bias, kwargs = chunked_case(name)
  # Chunks of 4 keys (and blocks of 4 or 3 queries): T = 10 is not a
  # multiple, so the last is padded; with 3, the diagonal crosses blocks.
  attend = lambda *a, **kw: variant('chunked')(
      *a, chunk_size=4, query_chunk_size=query_chunk, **kw)
  out, reference_grads = dense_of_chunked_case(name)
  chex.assert_trees_all_close(
      attend(q, k, v, bias, **kwargs), out, **tolerance.FLOAT32)
  chex.assert_trees_all_close(grads(attend, q, k, v, bias, **kwargs),
                              reference_grads, **tolerance.FLOAT32)


@pytest.mark.core
def test_causal_chunked_visits_only_blocks_on_or_below_the_diagonal():
  def visits(q_len, kv_len, q_chunk, kv_chunk):
    plan = chunk_plan.Plan(1, q_len, 1, 1, kv_len, 1, 1.0, True, q_chunk,
                         kv_chunk)
    seen = plan.key_chunks_seen()
    # The backward pass visits the same blocks, a chunk of keys at a time.
    first = plan.first_query_block()
    assert sum(plan.num_q_chunks - f for f in first) == seen.sum()
    return seen.tolist()

  # 8 x 8 blocks: 36 of the 64 dense ones.
  assert visits(4096, 4096, 512, 512) == [1, 2, 3, 4, 5, 6, 7, 8]
  assert visits(10, 10, 3, 4) == [1, 2, 3, 3]
  # Decoding one query after a cache of 999 keys reads them all.
  assert visits(1, 1000, 1, 512) == [2]
  # More queries than keys: the first 5 see no key at all.
  assert visits(13, 8, 4, 4) == [0, 1, 2, 2]


def test_chunked_rows_with_nothing_to_attend_are_zero_and_finite():
  q, k, v = make_qkv(1)
  mask = np.ones((B, 1, T, T), bool)
  mask[1, :, :3] = False  # Three queries of example 1 see no key at all.
  mask[0, :, :, 4:] = False  # Whole chunks of keys are masked for example 0.
  mask = jnp.asarray(mask)
  attend = lambda *a, **kw: variant('chunked')(*a, chunk_size=4, **kw)
  out = attend(q, k, v, mask=mask)
  np.testing.assert_array_equal(out[1, :3], 0.0)
  chex.assert_trees_all_close(
      out, dense(q, k, v, mask=mask), **tolerance.FLOAT32)
  for g in grads(attend, q, k, v, mask=mask):
    assert np.isfinite(g).all()


MASK_OPTIONS = {'chunked': dict(chunk_size=4), 'local': dict(window=3),
                'strided': dict(stride=3), 'fixed': dict(block=4, summary=1),
                'bigbird': dict(block=2, num_random_blocks=1),
                'additive': dict(zip(
                    ('query_weight', 'key_weight', 'score_weight'),
                    (jax.random.normal(jax.random.key(17), shape)
                     for shape in ((N, H, 5), (N, H, 5), (N, 5)))))}


@pytest.mark.parametrize('name', [n for n in distinct_variants()
                                  if attention.spec(n).masks == 'any'])
def test_segment_ids_mask_as_the_array_they_stand_for(name):
  """Packed rows: a SegmentMask gives the outputs and gradients that the
  [B, 1, T, T] mask of equal ids gives."""
  ids = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0],
                  [1, 1, 1, 1, 1, 1, 2, 2, 0, 0]])
  array_mask = jnp.asarray(ids[:, None, :, None] == ids[:, None, None, :])
  segments = attention.SegmentMask(jnp.asarray(ids), jnp.asarray(ids))
  q, k, v = make_qkv(15)
  fn = variant(name)
  options = dict(is_causal=True, **MASK_OPTIONS.get(name, {}))
  chex.assert_trees_all_close(fn(q, k, v, mask=segments, **options),
               fn(q, k, v, mask=array_mask, **options), **tolerance.FLOAT32)
  chex.assert_trees_all_close(
      grads(fn, q, k, v, mask=segments, **options),
      grads(fn, q, k, v, mask=array_mask, **options), **tolerance.FLOAT32)


def test_segment_ids_of_the_wrong_shape_are_refused():
  q, k, v = make_qkv(16)
  ids = jnp.ones((B, T + 1), jnp.int32)
  with pytest.raises(ValueError, match=r'segment ids have shapes'):
    variant('chunked')(q, k, v, mask=attention.SegmentMask(ids, ids))


def position_biases(length=T):
  """An ALiBi, a T5 and a Shaw relative bias over `length` positions, and
  the parameters each is differentiable in."""
  from model import positions  # The position schemes build PositionBias.
  base = jnp.tile(jnp.arange(length), (B, 1)) + 2
  q = jax.random.normal(jax.random.key(20), (B, length, N, H))
  t5 = positions.T5Bias(N, 8, 6, bidirectional=True)
  shaw = positions.ShawRelative(H, 3)
  t5_params = t5.init(jax.random.key(21), base, base)
  shaw_params = shaw.init(jax.random.key(22), q, base, base, 0.5)
  return {
      'alibi': (lambda _: positions.alibi_bias(base, base, N), {}),
      't5_bias': (lambda p: t5.apply(p, base, base), t5_params),
      'relative': (lambda p: shaw.apply(p, q, base, base, 0.5), shaw_params),
  }


@pytest.mark.parametrize('position', ['alibi', 't5_bias', 'relative'])
@pytest.mark.parametrize('name, options', [
    ('chunked', dict(chunk_size=4)), ('local', dict(window=3)),
    ('bigbird', dict(block=2, num_random_blocks=1))])
def test_position_biases_give_dense_results_without_a_full_bias(
    name, options, position):
  make_bias, params = position_biases()[position]
  q, k, v = make_qkv(13)
  allowed = {'chunked': np.ones((T, T), bool),
             'local': local_pattern(T, 3, causal=True)}.get(name)
  if name == 'bigbird':
    allowed = bigbird_pattern(T, 2, 1, sparse.bigbird_random_blocks(
        5, 1, 1, seed=0), causal=True)

  def ours(params, q):
    return variant(name)(q, k, v, make_bias(params), is_causal=True,
                         **options)

  def reference(params, q):
    return dense(q, k, v, make_bias(params), mask=explicit(allowed),
                 is_causal=True)

  chex.assert_trees_all_close(
      ours(params, q), reference(params, q), **tolerance.FLOAT32)
  loss = lambda fn: lambda p, q: jnp.sum(jnp.sin(fn(p, q)))
  ours_grads = jax.grad(loss(ours), argnums=(0, 1))(params, q)
  reference_grads = jax.grad(loss(reference), argnums=(0, 1))(params, q)
  chex.assert_trees_all_close(ours_grads, reference_grads,
                              **tolerance.FLOAT32)


# --- sparse patterns: exact under their masks ---

SPARSE_CASES = [
    ('local', dict(window=3), lambda c: local_pattern(T, 3, c)),
    ('local', dict(window=4), lambda c: local_pattern(T, 4, c)),
    ('strided', dict(stride=3), lambda c: strided_pattern(T, 3, c)),
    ('strided', dict(stride=4), lambda c: strided_pattern(T, 4, c)),
    ('fixed', dict(block=3, summary=1), lambda c: fixed_pattern(T, 3, 1, c)),
    ('fixed', dict(block=4, summary=2), lambda c: fixed_pattern(T, 4, 2, c)),
]


@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('name, options, pattern', SPARSE_CASES,
                         ids=[f'{n}-{o}' for n, o, _ in SPARSE_CASES])
def test_sparse_pattern_equals_dense_under_its_explicit_mask(
    name, options, pattern, causal):
  q, k, v = make_qkv(2)
  mask = padding()
  expected = dense(q, k, v, mask=explicit(pattern(causal)) & mask)
  out = variant(name)(q, k, v, mask=mask, is_causal=causal, **options)
  chex.assert_trees_all_close(out, expected, **tolerance.FLOAT32)


@pytest.mark.core
def test_local_with_a_window_over_the_whole_sequence_is_dense():
  q, k, v = make_qkv(3)
  for causal in (False, True):
    chex.assert_trees_all_close(
        variant('local')(q, k, v, is_causal=causal, window=T),
        dense(q, k, v, is_causal=causal), **tolerance.FLOAT32)


@pytest.mark.parametrize('name, options, pattern', [
    ('local', dict(window=3), local_pattern(T, 3, True)),
    ('strided', dict(stride=3), strided_pattern(T, 3, True)),
    ('fixed', dict(block=4, summary=1), fixed_pattern(T, 4, 1, True)),
])
@pytest.mark.parametrize('num_kv_heads', [1, 4])
def test_sparse_bias_and_gradients_match_dense(name, options, pattern,
                                               num_kv_heads):
  q, k, v = make_qkv(4, num_kv_heads)
  bias = jax.random.normal(jax.random.key(5), (B, 1, T, T))
  mask = jnp.asarray(np.random.default_rng(0).random((1, N, T, T)) > 0.2)
  ours = grads(variant(name), q, k, v, bias, mask=mask, is_causal=True,
               **options)
  reference = grads(dense, q, k, v, bias, mask=explicit(pattern) & mask,
                    is_causal=True)
  chex.assert_trees_all_close(ours, reference, **tolerance.FLOAT32)


@pytest.mark.parametrize('causal', [False, True])
def test_bigbird_equals_dense_under_its_explicit_mask(causal):
  q, k, v = make_qkv(6, q_len=16, kv_len=16)
  random_blocks = sparse.bigbird_random_blocks(8, 1, 2, seed=7)
  allowed = bigbird_pattern(16, 2, 1, random_blocks, causal)
  out = variant('bigbird')(q, k, v, is_causal=causal, block=2,
                           num_global_blocks=1, num_random_blocks=2,
                           seed=7)
  chex.assert_trees_all_close(
      out, dense(q, k, v, mask=explicit(allowed)), **tolerance.FLOAT32)


def test_bigbird_global_rows_take_bias_and_per_query_masks():
  # T = 11 is not a multiple of the block; K = 1 (multi-query).
  length = 11
  q, k, v = make_qkv(14, num_kv_heads=1, q_len=length, kv_len=length)
  bias = jax.random.normal(jax.random.key(15), (1, N, length, length))
  mask = jnp.asarray(
      np.random.default_rng(1).random((B, 1, length, length)) > 0.3)
  allowed = bigbird_pattern(length, 2, 2, sparse.bigbird_random_blocks(
      6, 2, 1, seed=4), causal=False)
  bigbird = lambda q, k, v, bias, **kw: variant('bigbird')(
      q, k, v, bias, block=2, num_global_blocks=2, num_random_blocks=1,
      seed=4, **kw)
  ours = grads(bigbird, q, k, v, bias, mask=mask)
  reference = grads(dense, q, k, v, bias, mask=explicit(allowed) & mask)
  chex.assert_trees_all_close(
      bigbird(q, k, v, bias, mask=mask),
      dense(q, k, v, bias, mask=explicit(allowed) & mask), **tolerance.FLOAT32)
  chex.assert_trees_all_close(ours, reference, **tolerance.FLOAT32)


def test_bigbird_with_every_block_global_is_dense():
  q, k, v = make_qkv(7)
  out = variant('bigbird')(q, k, v, mask=padding(), block=2,
                           num_global_blocks=5)
  chex.assert_trees_all_close(
      out, dense(q, k, v, mask=padding()), **tolerance.FLOAT32)


def test_bigbird_random_blocks_follow_the_seed():
  first = sparse.bigbird_random_blocks(16, 2, 3, seed=1)
  assert (first == sparse.bigbird_random_blocks(16, 2, 3, seed=1)).all()
  assert (first != sparse.bigbird_random_blocks(16, 2, 3, seed=2)).any()
  for i, chosen in enumerate(first):
    assert all(j >= 2 and abs(j - i) > 1 for j in chosen)
    assert len(set(chosen)) == len(chosen)


# --- kernelised and low-rank: approximations that improve ---


def kernel_reference(phi_q, phi_k, v, causal, keep=None):
  """sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j), written out."""
  phi_k = jnp.repeat(phi_k, N // phi_k.shape[2], axis=2)
  v = jnp.repeat(v, N // v.shape[2], axis=2)
  scores = jnp.einsum('btnf,bsnf->bnts', phi_q, phi_k)
  if causal:
    scores = jnp.where(np.tril(np.ones((T, T), bool)), scores, 0.0)
  if keep is not None:
    scores = jnp.where(keep, scores, 0.0)
  return (jnp.einsum('bnts,bsnh->btnh', scores, v)
          / jnp.sum(scores, -1).transpose(0, 2, 1)[..., None])


@pytest.mark.parametrize('causal', [False, True])
def test_linear_attention_honours_a_key_mask_per_query_head(causal):
  q, k, v = make_qkv(16)  # Two query heads per key head.
  keep = np.ones((B, N, 1, T), bool)
  keep[:, 1, :, 3:] = False  # Only head 1 loses keys 3 and later.
  keep = jnp.asarray(keep)
  phi = lambda x: jax.nn.elu(x) + 1
  out = variant('linear')(q, k, v, mask=keep, is_causal=causal,
                          chunk_size=4)
  chex.assert_trees_all_close(
      out, kernel_reference(phi(q), phi(k), v, causal, keep),
      **tolerance.FLOAT32)


def log_space_kernel_reference(log_phi_q, log_phi_k, v, causal, keep):
  """sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j) from the log
  features [B, T, N or K, F], summed in log space (exact at any norm)."""
  repeat = lambda x: jnp.repeat(x, N // x.shape[2], axis=2)
  log_phi_k, v = repeat(log_phi_k), repeat(v).astype(jnp.float32)
  logits = jax.nn.logsumexp(log_phi_q[:, :, None, :, :]  # [B, T, S, N, F]
                            + log_phi_k[:, None, :, :, :], axis=-1)
  allowed = jnp.broadcast_to(keep[:, 0, 0][:, None, :, None], logits.shape)
  if causal:
    allowed &= np.tril(np.ones((T, T), bool))[None, :, :, None]
  logits = jnp.where(allowed, logits, -jnp.inf)
  weights = jnp.exp(logits - jnp.max(logits, axis=2, keepdims=True))
  return (jnp.einsum('btsn,bsnh->btnh', weights, v)
          / jnp.sum(weights, axis=2)[..., None])


def log_elu_features(x):
  """log(elu(x) + 1), linear attention's feature map."""
  x = x.astype(jnp.float32)
  return jnp.where(x < 0, x, jnp.log1p(jnp.maximum(x, 0.0)))


def log_performer_features(x, num_features, seed):
  """log phi(x) of FAVOR+ with performer's default scale 1 / sqrt(H)."""
  w = kernel.orthogonal_features(jax.random.key(seed), num_features, H)
  x = x.astype(jnp.float32) * H ** -0.25
  return (jnp.einsum('bthd,md->bthm', x, w)
          - jnp.sum(x * x, -1, keepdims=True) / 2 - np.log(num_features) / 2)


# Key norms per position: the first queries (a whole chunk of 4, then
# two at the start of the next, before key 6) see only keys of 20 to 40
# times the others' norm. Performer's features of those lie hundreds of
# nats below the others': an unshifted exp underflows them all to zero, a
# shift shared by a chunk or by the sequence leaves those queries nothing.
NORMS = jnp.asarray([40, 30, 20, 40, 40, 30, 1, 1, 3, 1.0])[
    None, :, None, None]


def large_negative(k, factor=1.0):
  """Keys of NORMS below zero in every component: linear's features of the
  first six, e^k, lie 20 to 50 nats below 1 at factor 1 (under the 2^-24
  that elu's expm1(k) + 1 resolves), over 105 at factor 5 (under float32's
  smallest, e^-103 with subnormals)."""
  return -factor * (jnp.abs(k) + 1) * NORMS


KERNEL_CASES = {
    # name: (variant, is_causal, kv heads, chunk_size, dtype, keys of k)
    'linear_causal_gqa_padding': ('linear', True, 2, 4, jnp.float32,
                                  lambda k: k),
    'performer_bidirectional_mqa': ('performer', False, 1, None,
                                    jnp.float32, lambda k: k),
    'performer_causal_gqa_padding': ('performer', True, 2, 4, jnp.float32,
                                     lambda k: k),
    'performer_causal_bfloat16': ('performer', True, 4, 3, jnp.bfloat16,
                                  lambda k: k),
    'performer_causal_large_keys': ('performer', True, 2, 4, jnp.float32,
                                    lambda k: k * NORMS),
    # Features summed as they are: large of both signs (up to 1 + 100,
    # down to e^-100 beside others), and far below 1 in every component.
    'linear_causal_large_keys': ('linear', True, 2, 4, jnp.float32,
                                 lambda k: k * NORMS),
    'linear_causal_large_negative_keys': ('linear', True, 2, 4, jnp.float32,
                                          large_negative),
    # A feature map of its own per key/value head, more features than H.
    'hedgehog_causal_gqa_padding': ('hedgehog', True, 2, 4, jnp.float32,
                                    lambda k: k),
    'hedgehog_bidirectional_mqa': ('hedgehog', False, 1, None, jnp.float32,
                                   lambda k: k),
    'hedgehog_causal_bfloat16': ('hedgehog', True, 4, 3, jnp.bfloat16,
                                 lambda k: k),
}


def log_hedgehog_features(x, feature_map):
  """log phi(x) = log softmax([x W, -x W]) of hedgehog, each of x's heads
  read through the map of its key/value head (x: queries or keys)."""
  weights = jnp.repeat(feature_map, x.shape[2] // feature_map.shape[0], 0)
  projected = jnp.einsum('bthd,hdf->bthf', x.astype(jnp.float32), weights)
  return jax.nn.log_softmax(jnp.concatenate([projected, -projected], -1),
                            axis=-1)


@pytest.mark.parametrize('case', KERNEL_CASES)
def test_parallel_chunk_kernel_attention_equals_the_quadratic_form(case):
  """Outputs and gradients against phi(q) phi(k)^T masked and normalised,
  written out in log space: chunk sizes that do not divide T = 10, a
  padded example, grouped heads."""
  name, causal, kv_heads, chunk_size, dtype, keys = KERNEL_CASES[case]
  q, k, v = make_qkv(21, num_kv_heads=kv_heads)
  q, k, v = (x.astype(dtype) for x in (q, keys(k), v))
  keep = padding()
  if name == 'linear':
    options, features = {}, log_elu_features
  elif name == 'hedgehog':
    feature_map = jax.random.normal(jax.random.key(23), (kv_heads, H, 12))
    options = dict(feature_map=feature_map)
    features = functools.partial(log_hedgehog_features,
                                 feature_map=feature_map)
  else:
    options = dict(num_features=16, seed=5)
    features = functools.partial(log_performer_features, num_features=16,
                                 seed=5)

  def ours(q, k, v):
    return variant(name)(q, k, v, mask=keep, is_causal=causal,
                         chunk_size=chunk_size, **options)

  def reference(q, k, v):
    return log_space_kernel_reference(features(q), features(k), v, causal,
                                      keep).astype(q.dtype)

  @jax.jit
  def outputs_and_grads(q, k, v):
    """Each function's output, and the gradients of sum(sin(output)) with
    respect to q, k and v: one program for all four."""
    results = []
    for fn in (ours, reference):
      out, pullback = jax.vjp(fn, q, k, v)
      results.append((out, pullback(jnp.cos(out))))
    return results

  error = 3e-2 if dtype == jnp.bfloat16 else 2e-5
  (out, grads), (expected, expected_grads) = outputs_and_grads(q, k, v)
  as_float32 = functools.partial(jax.tree.map, lambda x: x.astype(jnp.float32))
  chex.assert_tree_all_finite(out)
  chex.assert_trees_all_close(as_float32(out), as_float32(expected),
                              atol=error, rtol=error)
  chex.assert_trees_all_close(as_float32(grads), as_float32(expected_grads),
                              atol=10 * error, rtol=10 * error)


def _softmax64(z):
  e = np.exp(z - z.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


# Hedgehog's maps of the projections z = x W [..., F], in float64 numpy.
HEDGEHOG_MAPS_64 = {
    'hedgehog': lambda z: _softmax64(np.concatenate([z, -z], axis=-1)),
    'lolcats': lambda z: np.concatenate([_softmax64(z), _softmax64(-z)],
                                        axis=-1),
    'one_sided': _softmax64,
}


@pytest.mark.parametrize('phi', [None, 'lolcats', 'one_sided'])
def test_hedgehog_maps_equal_their_float64_formulas(phi):
  """By default the paper's map, one softmax over [x W, -x W] (Zhang et al.
  2024); `phi='lolcats'` a softmax over each sign (LoLCATs, Zhang et al.
  2025); `phi='one_sided'` softmax(x W). Causal, grouped heads, a padded
  example: sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j) over the
  keys j <= i that are kept, written out in float64."""
  q, k, v = make_qkv(25)
  feature_map = jax.random.normal(jax.random.key(26), (2, H, 6))
  keep = padding()
  ours = jax.jit(functools.partial(
      kernel.hedgehog_attention, mask=keep, is_causal=True, chunk_size=4,
      **({} if phi is None else {'phi': phi})))(
          q, k, v, feature_map=feature_map)
  group = N // 2
  q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, feature_map))
  k, v, w = (np.repeat(x, group, axis) for x, axis in ((k, 2), (v, 2),
                                                        (w, 0)))
  features = HEDGEHOG_MAPS_64[phi or 'hedgehog']
  phi_q, phi_k = (features(np.einsum('bthd,hdf->bthf', x, w)) for x in (q, k))
  allowed = np.tril(np.ones((T, T), bool)) & np.asarray(keep)  # [B, 1, T, S]
  weights = np.einsum('bthf,bshf->bhts', phi_q, phi_k) * allowed
  want = np.einsum('bhts,bshd->bthd', weights / weights.sum(-1, keepdims=True),
                   v)
  chex.assert_trees_all_close(np.asarray(ours, np.float64), want,
                              **tolerance.FLOAT32)


def test_hedgehog_refuses_a_map_it_does_not_know():
  q, k, v = make_qkv(27)
  with pytest.raises(ValueError, match="phi='two_sided' must be one of "
                     "'hedgehog', 'lolcats', 'one_sided'"):
    kernel.hedgehog_attention(q, k, v, feature_map=jnp.ones((2, H, 4)),
                              phi='two_sided')


def test_hedgehog_starts_as_softmax_features_and_learns_its_map():
  """Its parameter starts as the identity on the first min(H, F) features
  of each key/value head (phi(x) = softmax([x, -x]) where F = H), and the
  output's gradient reaches it."""
  class Layer(nn.Module):
    @nn.compact
    def __call__(self):
      return kernel.hedgehog_parameters(self, types.SimpleNamespace(
          head_dim=H, num_kv_heads=2, weight_dtype=jnp.float32),
                                        num_features=6, chunk_size=4)

  options = nn.meta.unbox(Layer().init_with_output(jax.random.key(0))[0])
  assert options['chunk_size'] == 4
  feature_map = options['feature_map']
  np.testing.assert_array_equal(feature_map, np.broadcast_to(
      np.eye(H, 6), (2, H, 6)))
  q, k, v = make_qkv(24)
  gradient = jax.jit(jax.grad(lambda w: jnp.sum(jnp.sin(
      kernel.hedgehog_attention(q, k, v, is_causal=True, feature_map=w,
                                chunk_size=4)))))(feature_map)
  assert np.all(np.abs(gradient).sum(axis=(1, 2)) > 0)


def test_linear_attention_drops_keys_whose_every_feature_underflows():
  """linear sums its features unshifted: a key whose features all lie
  below float32's range counts as 0, so queries that see only such keys
  (the first six) get zeros, finite with finite gradients, and the queries
  after them, which see a key of features near 1, stay exact."""
  q, k, v = make_qkv(21)
  k = large_negative(k, factor=5.0)
  keep = jnp.ones((B, 1, 1, T), bool)

  @jax.jit
  def output_and_grads(q, k, v):
    out, pullback = jax.vjp(functools.partial(
        variant('linear'), is_causal=True, chunk_size=4), q, k, v)
    return out, pullback(jnp.cos(out))

  out, grads = output_and_grads(q, k, v)
  chex.assert_tree_all_finite(grads)
  np.testing.assert_array_equal(out[:, :6], 0.0)
  chex.assert_trees_all_close(
      out[:, 6:], log_space_kernel_reference(
          log_elu_features(q), log_elu_features(k), v, True, keep)[:, 6:],
      atol=2e-5, rtol=2e-5)


def mean_error(fn, seeds=(0, 1, 2), **kwargs) -> float:
  """Over the seeds, fn's mean absolute error against dense (one compiled
  call for all of them)."""
  q, k, v = (jnp.stack(x) for x in zip(*[make_qkv(seed, scale=0.5)
                                         for seed in seeds]))
  causal = kwargs.get('is_causal', False)
  error = jax.jit(jax.vmap(lambda q, k, v: jnp.mean(jnp.abs(
      fn(q, k, v, **kwargs) - dense(q, k, v, is_causal=causal)))))
  return float(np.mean(error(q, k, v)))


@pytest.mark.parametrize('causal', [False, True])
def test_performer_error_falls_as_features_grow(causal):
  # chunk_size 4: T = 10 is not a multiple of the causal chunk.
  errors = [mean_error(variant('performer'), is_causal=causal,
                       num_features=m, seed=3, chunk_size=4)
            for m in (4, 64, 1024, 16384)]
  assert errors[0] > errors[1] > errors[2] > errors[3]
  # An unbiased estimate's error falls like 1 / sqrt(m).
  assert errors[3] < 0.006


def test_performer_features_are_orthogonal_and_unbiased():
  w = kernel.orthogonal_features(jax.random.key(0), 2**15, 8)
  gram = w[:8] @ w[:8].T
  np.testing.assert_allclose(gram - np.diag(np.diag(gram)), 0.0, atol=1e-4)
  # Directions uniform on the sphere: the mean of w tends to 0.
  assert np.abs(np.asarray(w).mean(0)).max() < 0.03


def test_linformer_at_full_rank_with_identity_projections_is_dense():
  q, k, v = make_qkv(9)
  identity = jnp.eye(T)
  out = variant('linformer')(q, k, v, key_projection=identity,
                             value_projection=identity)
  chex.assert_trees_all_close(out, dense(q, k, v), **tolerance.FLOAT32)


def test_linformer_error_falls_as_rank_grows():
  # Projections onto a random subset of the keys (rows of a permutation):
  # the larger the rank, the more of the keys are kept.
  rows = np.random.default_rng(0).permutation(np.eye(T))

  def linformer_rank(q, k, v, rank):
    projection = jnp.asarray(rows[:rank])
    return variant('linformer')(q, k, v, key_projection=projection,
                                value_projection=projection)
  errors = [mean_error(linformer_rank, rank=r) for r in (2, 5, 8, 10)]
  assert errors[0] > errors[1] > errors[2] > errors[3]
  assert errors[3] < 1e-6


def test_linformer_ignores_padded_keys():
  q, k, v = make_qkv(10)
  projection = jax.random.normal(jax.random.key(0), (4, T))
  mask = padding()
  changed_k = k.at[1, 6:].set(100.0)
  changed_v = v.at[1, 6:].set(-100.0)
  linformer = lambda k, v: variant('linformer')(
      q, k, v, mask=mask, key_projection=projection,
      value_projection=projection)
  chex.assert_trees_all_close(
      linformer(k, v), linformer(changed_k, changed_v), **tolerance.FLOAT32)


def test_additive_attention_matches_bahdanau_score():
  q, k, v = make_qkv(11, num_kv_heads=N)
  hidden = 5
  keys = jax.random.split(jax.random.key(1), 3)
  w_q = jax.random.normal(keys[0], (N, H, hidden))
  w_k = jax.random.normal(keys[1], (N, H, hidden))
  w_v = jax.random.normal(keys[2], (N, hidden))
  score = np.zeros((B, N, T, T))
  for b in range(B):
    for n in range(N):
      for i in range(T):
        for j in range(T):
          score[b, n, i, j] = w_v[n] @ np.tanh(q[b, i, n] @ w_q[n]
                                               + k[b, j, n] @ w_k[n])
  weights = jax.nn.softmax(jnp.where(padding(), score, -jnp.inf), axis=-1)
  expected = jnp.einsum('bnts,bsnh->btnh', weights, v)
  out = variant('additive')(q, k, v, mask=padding(), query_weight=w_q,
                            key_weight=w_k, score_weight=w_v)
  chex.assert_trees_all_close(out, expected, **tolerance.FLOAT32)


# --- memory-compressed ---


def compress_by_loops(x, kernel, stride):
  """The strided convolution written out: window j covers positions
  j * stride + stride - W .. j * stride + stride - 1, zeros outside."""
  x, kernel = np.asarray(x), np.asarray(kernel)
  window = kernel.shape[0]
  out = np.zeros((x.shape[0], -(-x.shape[1] // stride)) + x.shape[2:])
  for j in range(out.shape[1]):
    for w in range(window):
      position = j * stride + stride - window + w
      if 0 <= position < x.shape[1]:
        out[:, j] += np.einsum('bkh,khlm->blm', x[:, position], kernel[w])
  return out


@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('window, stride', [(3, 3), (4, 2)])
def test_memory_compressed_equals_dense_over_compressed_keys(window, stride,
                                                             causal):
  q, k, v = make_qkv(18)
  kernels = [jax.random.normal(key, (window, 2, H, 2, H)) / 8
             for key in jax.random.split(jax.random.key(19))]
  out = variant('memory_compressed')(
      q, k, v, mask=padding(), is_causal=causal, key_kernel=kernels[0],
      value_kernel=kernels[1], stride=stride)
  keep = np.asarray(padding())[:, 0, 0, :, None, None]
  k_c, v_c = (jnp.asarray(compress_by_loops(x * keep, kernel, stride),
                          jnp.float32)
              for x, kernel in zip((k, v), kernels))
  # Compressed key j: a window with a real key, ending at or before i.
  ends = np.arange(k_c.shape[1]) * stride + stride - 1
  starts = ends - window + 1
  lengths = np.array([T, 6])
  allowed = np.broadcast_to(starts[None, None, None, :]
                            < lengths[:, None, None, None],
                            (B, 1, T, k_c.shape[1]))
  if causal:
    allowed = allowed & (ends[None, :] <= np.arange(T)[:, None])
  chex.assert_trees_all_close(
      out, dense(q, k_c, v_c, mask=jnp.asarray(allowed)), **tolerance.FLOAT32)
  if causal:  # The first stride - 1 queries read no key.
    np.testing.assert_array_equal(out[:, :stride - 1], 0.0)


def compiled_temp_bytes(fn, *shapes) -> int:
  """Temporary memory of `fn` compiled for arguments of `shapes`. XLA
  assigns the buffers before its backend generates the code, so the
  backend's optimisation level (0 here: half the compile time on CPU)
  leaves them as they are."""
  compiled = jax.jit(fn).lower(*shapes).compile(
      compiler_options={'xla_backend_optimization_level': 0})
  return compiled.memory_analysis().temp_size_in_bytes


def test_memory_compressed_scores_take_a_stride_th_of_dense_memory():
  """Compiled temporaries of the forward pass at T = 3072: the [B, N, T,
  S / 3] scores against dense's [B, N, T, S]."""
  length = 3072
  shape = jax.ShapeDtypeStruct((1, length, 4, 32), jnp.float32)
  kernel = jax.ShapeDtypeStruct((3, 4, 32, 4, 32), jnp.float32)

  temp = lambda fn, *args: compiled_temp_bytes(fn, shape, shape, shape, *args)

  compressed = temp(lambda q, k, v, kk, vk: variant('memory_compressed')(
      q, k, v, key_kernel=kk, value_kernel=vk), kernel, kernel)
  full = temp(lambda q, k, v: dense(q, k, v))
  assert 0.25 <= compressed / full <= 0.4, compressed / full


# --- what a variant cannot do ---


@pytest.mark.parametrize('name, kwargs, message', [
    ('linformer', dict(is_causal=True, key_projection=jnp.eye(T),
                       value_projection=jnp.eye(T)), 'cannot be causal'),
    ('linear', dict(bias=jnp.zeros((1, N, T, T))), 'bias'),
    ('performer', dict(mask=jnp.ones((1, 1, T, T), bool)), 'key padding'),
    ('linear', dict(scale=0.5), 'no logit scale'),
    ('local', dict(q_len=4), 'self-attention'),
    ('chunked', dict(chunk_size=0), 'chunk_size=0'),
    ('fixed', dict(block=2, summary=3), 'summary=3'),
])
def test_unsupported_inputs_raise_a_clear_error(name, kwargs, message):
  kwargs = dict(kwargs)
  q, k, v = make_qkv(12, q_len=kwargs.pop('q_len', T))
  with pytest.raises(ValueError, match=message):
    variant(name)(q, k, v, **kwargs)


# --- memory: O(T * chunk) against O(T^2) ---


def temp_bytes(name: str, length: int, **options) -> int:
  """Temporary memory of the compiled forward and backward pass."""
  fn = variant(name)
  shape = jax.ShapeDtypeStruct((1, length, 4, 32), jnp.float32)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, is_causal=True, **options))
  return compiled_temp_bytes(jax.grad(loss, argnums=(0, 1, 2)), shape, shape,
                             shape)


@pytest.mark.slow
def test_memory_of_chunked_local_and_linear_grows_linearly():
  lengths = (2048, 8192)
  memory = {name: [temp_bytes(name, t, **options) for t in lengths]
            for name, options in [('dense', {}), ('chunked', {}),
                                  ('local', {'window': 256}), ('linear', {}),
                                  ('performer', {'num_features': 64}),
                                  ('bigbird', {'num_random_blocks': 2})]}
  dense_small, dense_large = memory.pop('dense')
  assert dense_large / dense_small > 12  # Quadratic: 16x for 4x the length.
  for name, (small, large) in memory.items():
    if name in ('chunked', 'local', 'linear'):
      assert large <= dense_large / 8, name
    assert large / small <= 4 * 1.5, name  # Linear, within 1.5x.


@pytest.mark.parametrize('name, options', [('chunked', {}),
                                           ('local', {'window': 256})])
def test_memory_stays_linear_with_a_relative_position_bias(name, options):
  from model import positions  # The position schemes build PositionBias.

  def temp_bytes_with_alibi(length):
    fn = variant(name)
    shape = jax.ShapeDtypeStruct((1, length, 4, 32), jnp.float32)
    positions_1xT = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def loss(q, k, v, at):
      bias = positions.alibi_bias(at, at, 4)
      return jnp.sum(fn(q, k, v, bias, is_causal=True, **options))
    return compiled_temp_bytes(jax.grad(loss, argnums=(0, 1, 2)), shape,
                               shape, shape, positions_1xT)

  small, large = temp_bytes_with_alibi(2048), temp_bytes_with_alibi(8192)
  assert large / small <= 4 * 1.5
