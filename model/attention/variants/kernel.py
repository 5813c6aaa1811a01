"""Kernelised (linear-time) attention: `linear`, `performer` and
`hedgehog`.

softmax(q k^T) is replaced by a feature map phi with phi(q) . phi(k) as the
similarity, so attention regroups as phi(q) (sum_j phi(k_j) v_j^T): O(T)
in the sequence length. Causal attention sums over the keys before each
query in the parallel chunk form (see `_causal_sums`): quadratic only
inside a chunk, the states summed per chunk, so memory is
O(T * (chunk + F * H / chunk)) rather than the O(T * F * H) of a prefix
sum per position, in O(log(T / chunk)) dependent steps rather than
T / chunk. Features that can overflow float32 (Performer's exponentials)
carry stabilising shifts that cancel; linear's (elu + 1, at most 1 + x)
and hedgehog's (a softmax, at most 1) are summed as they are.
"""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention import core

Array = jax.Array


def _check(name: str, query, key, value, bias, mask, is_causal) -> None:
  core.check_inputs(query, key, value, bias, mask)
  if bias is not None:
    raise ValueError(f'{name} attention cannot add a bias to logits it never '
                     'forms.')
  if mask is not None and mask.shape[2] != 1:
    raise ValueError(
        f'{name} attention honours key padding masks only (shape [B, 1, 1, S] '
        f'or with a T axis of 1), not a per-query mask of shape {mask.shape}.')
  if is_causal and query.shape[1] != key.shape[1]:
    raise ValueError(f'causal {name} attention needs query length '
                     f'{query.shape[1]} == key length {key.shape[1]}.')


def _heads_first(x: Array) -> Array:
  """[B, T, N, H] <-> [B, N, T, H]."""
  return jnp.swapaxes(x, 1, 2)


def _shifted_max(x: Array, axes) -> Array:
  """`_top` of x over `axes`, 0 where everything is -inf: a stabilising
  shift, under stop_gradient."""
  top = _top(x, axes)
  return jnp.where(jnp.isfinite(top), top, 0.0)


def _relative_to_largest(log_phi: Array) -> tuple[Array, Array]:
  """(exp(log_phi - r), r): features [..., F] from their logs, relative to
  their largest, whose log r [...] is taken under stop_gradient."""
  top = _top(log_phi, -1)
  return jnp.exp(log_phi - top), top[..., 0]


def _attend(phi_q: Array, phi_k: Array, value: Array, mask: Array | None,
            *, is_causal: bool, chunk_size: int | None,
            key_top: Array | None = None) -> Array:
  """sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j) over the allowed j.

  Heads first: phi_q [B, N, T, F], the key features phi_k [B, K, S, F],
  value [B, K, S, H]; float32 out [B, N, T, H]. Features that could
  overflow float32 come in units of exp(key_top) [B, K, S] (each key's
  relative to its largest, and that largest's log), and are summed
  relative to a shift that cancels; without key_top, as they are. The
  matmuls take their operands in value's dtype (bfloat16 where the
  compute dtype is) and sum in float32. A query with no allowed key gets
  zeros.
  """
  batch, num_heads, q_len, features = phi_q.shape
  num_kv_heads, kv_len, head_dim = value.shape[1:]
  if mask is not None:  # [B?, N?, 1, S]: drop the masked keys.
    if mask.shape[1] != 1 and num_kv_heads != num_heads:
      # A mask per query head: each head needs keys of its own.
      phi_k, key_top, value = jax.tree.map(
          lambda x: jnp.repeat(x, num_heads // num_kv_heads, axis=1),
          (phi_k, key_top, value))
      num_kv_heads = num_heads
    keep = jnp.broadcast_to(mask[:, :, 0], (batch, num_heads, kv_len))
    keep = keep.reshape(batch, num_kv_heads, -1, kv_len)[:, :, 0]
    phi_k = jnp.where(keep[..., None], phi_k, 0.0)
    if key_top is not None:  # Nor may a masked key set a shift.
      key_top = jnp.where(keep, key_top, -jnp.inf)
  group = num_heads // num_kv_heads
  phi_q = phi_q.reshape(batch, num_kv_heads, group, q_len, features)
  if not is_causal:
    if key_top is not None:  # In units of the largest key's.
      phi_k = phi_k * _ratio(key_top, _shifted_max(key_top, 2))[..., None]
    state = _dot('bksf,bksh->bkfh', phi_k, value)
    total = jnp.sum(phi_k, axis=2)  # [B, K, F]
    numerator = _dot('bkgtf,bkfh->bkgth', phi_q, state, value.dtype)
    denominator = _dot('bkgtf,bkf->bkgt', phi_q, total, value.dtype)
  else:
    chunk = default_chunk_size() if chunk_size is None else chunk_size
    if chunk < 1:
      raise ValueError(f'chunk_size={chunk_size} must be positive.')
    numerator, denominator = _causal_sums(phi_q, phi_k, value, key_top,
                                          chunk=min(chunk, q_len))
  denominator = jnp.where(denominator > 0, denominator, 1.0)
  # Both divided by the denominator's value first, the division's gradient
  # (1 / denominator^2) stays finite where the features are tiny.
  unit = jax.lax.stop_gradient(denominator)
  out = (numerator / unit[..., None]) / (denominator / unit)[..., None]
  return out.reshape(batch, num_heads, q_len, head_dim)


def default_chunk_size() -> int:
  """Positions per chunk of causal kernelised attention on this backend:
  128 on a TPU (its matrix units' width), 64 elsewhere."""
  return 128 if jax.default_backend() == 'tpu' else 64


def _dot(spec: str, x: Array, y: Array, dtype=None) -> Array:
  """einsum(spec, x, y) with operands in `dtype` (default: y's) and float32
  sums."""
  dtype = dtype or y.dtype
  return jnp.einsum(spec, x.astype(dtype), y.astype(dtype),
                    preferred_element_type=jnp.float32)


def _top(x: Array, axis) -> Array:
  """The max over `axis` (kept), under stop_gradient; -inf where every
  element is -inf."""
  return jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))


def _ratio(top: Array, reference: Array) -> Array:
  """exp(top - reference), 0 where `top` is -inf (reference >= top where
  `top` is finite)."""
  finite = jnp.isfinite(top)
  return jnp.where(finite, jnp.exp(jnp.where(finite, top - reference, 0.0)),
                   0.0)


def _combine(earlier, later):
  """Two sums over keys, each (top [B, K, n], state [B, K, n, F, H],
  total [B, K, n, F]) in units of exp(top): their sum, in units of the
  larger top."""
  (top_a, state_a, total_a), (top_b, state_b, total_b) = earlier, later
  top = jnp.maximum(top_a, top_b)
  a, b = _ratio(top_a, top), _ratio(top_b, top)
  return (top, state_a * a[..., None, None] + state_b * b[..., None, None],
          total_a * a[..., None] + total_b * b[..., None])


def _causal_sums(phi_q: Array, phi_k: Array, value: Array,
                 key_top: Array | None, *, chunk: int) -> tuple[Array, Array]:
  """The causal numerator [B, K, G, T, H] and denominator [B, K, G, T]
  (float32, in units that cancel) of queries phi_q [B, K, G, T, F] over
  keys phi_k [B, K, T, F] (in units of exp(key_top) [B, K, T] where given,
  as `_attend` takes them) and values [B, K, T, H], in the parallel chunk
  form (Lightning Attention-2; Mamba-2's SSD): per chunk of C positions,
  the keys inside it as a masked [C, C] product, and the keys of the
  chunks before it as the query times their summed states
  sum_j phi(k_j) v_j^T, every chunk's prefix at once by a parallel scan
  over the chunks (O(log(T / C)) steps, not T / C).

  Exactness without key_top: features summed as they are, exact while
  their products and sums stay inside float32's range. Linear's grow only
  as 1 + x, and a key's fall out of it only where every component is below
  about -87 (-103 with subnormals): such a key counts as 0, and a query
  that sees only such keys gets zeros.

  Exactness with key_top. Exponentiated features can overflow or
  underflow float32, so each quantity carries a shift that cancels
  between numerator and denominator, under stop_gradient: each key's
  features come relative to that key's largest (r_j = key_top), each
  chunk's state is taken relative to the chunk's largest r_j, and the
  scan adds two chunks' states relative to the larger of their shifts. A
  query then weighs every key it sees relative to the largest r_j among
  them (a running max): that key's weight is exp(0) = 1, the others' at
  most 1, whatever the keys' norms, and a later key (in its chunk or after
  it) changes nothing before it. What can still round to zero: a key's
  feature more than ~87 nats (float32's exponent range) below that key's
  largest, or a key whose r_j lies that far below the query's reference;
  and the query's own features, phi(q) against the features of the keys
  it sees, if those products span more than that range (queries of very
  large norm).
  """
  batch, kv_heads, group, length, _ = phi_q.shape
  dtype = value.dtype
  padded = -(-length // chunk) * chunk
  chunks = padded // chunk

  def chunked(x, fill=0.0):  # [..., T, X] -> [..., n, C, X]
    pad = [(0, 0)] * x.ndim
    pad[-2] = (0, padded - length)
    x = jnp.pad(x, pad, constant_values=fill)
    return x.reshape(*x.shape[:-2], chunks, chunk, x.shape[-1])

  def earlier(x, fill=0.0):  # Chunk n's: chunk n - 1's inclusive sums.
    pad = [(0, 0)] * x.ndim
    pad[2] = (1, 0)
    return jnp.pad(x[:, :, :-1], pad, constant_values=fill)

  # Queries [B, K, n, G, C, F] (a copy only where G > 1), keys [B, K, n,
  # C, F], values [B, K, n, C, H]: each product below has its batch axes
  # first and its free axes in operand order, so that XLA needs no copy
  # (and XLA's CPU dot takes bfloat16 operands).
  q = jnp.moveaxis(chunked(phi_q), 2, 3)
  k = chunked(phi_k)
  v = chunked(value)
  causal = jnp.tril(jnp.ones((chunk, chunk), bool))
  if key_top is None:
    # Each chunk's sums, their inclusive prefix sums by a parallel scan
    # (jnp.cumsum's reduce-window takes a quarter longer on the CPU).
    states, totals = (jax.lax.associative_scan(jnp.add, x, axis=2) for x in (
        _dot('bkncf,bknch->bknfh', k, v, dtype), jnp.sum(k, axis=3)))
    # Every key a query sees weighs 1.
    weight, before = causal, None
  else:
    key_top = chunked(key_top[..., None], -jnp.inf)[..., 0]  # [B, K, n, C]
    # Each chunk's sum of phi(k_j) v_j^T and of phi(k_j), in units of its
    # largest r_j.
    chunk_top = _top(key_top, -1)[..., 0]  # [B, K, n]
    weighted = k * _ratio(key_top, chunk_top[..., None])[..., None]
    state = _dot('bkncf,bknch->bknfh', weighted, v, dtype)
    total = jnp.sum(weighted, axis=3)  # [B, K, n, F]
    # Inclusive prefix sums over the chunks.
    tops, states, totals = jax.lax.associative_scan(
        _combine, (chunk_top, state, total), axis=2)
    earlier_top = earlier(tops, -jnp.inf)
    # Each query's reference: the largest r_j it sees, [B, K, n, C].
    reference = jnp.maximum(jax.lax.cummax(key_top, axis=3),
                            earlier_top[..., None])
    weight = _ratio(jnp.where(causal, key_top[..., None, :], -jnp.inf),
                    reference[..., None])[:, :, :, None]
    # The chunks before: in units of the query's reference.
    before = _ratio(earlier_top[..., None], reference)[:, :, :, None]
  # Inside the chunk: scores [B, K, n, G, C (queries), C (keys)].
  scores = _dot('bkngcf,bkndf->bkngcd', q, k, dtype) * weight
  numerator = _dot('bkngcd,bkndh->bkngch', scores, v, dtype)
  denominator = jnp.sum(scores, axis=-1)  # [B, K, n, G, C]
  numerator_before = _dot('bkngcf,bknfh->bkngch', q, earlier(states), dtype)
  denominator_before = _dot('bkngcf,bknf->bkngc', q, earlier(totals), dtype)
  if before is not None:
    numerator_before *= before[..., None]
    denominator_before *= before
  numerator += numerator_before
  denominator += denominator_before

  def unchunked(x):  # [B, K, n, G, C, ...] -> [B, K, G, T, ...]
    x = jnp.moveaxis(x, 3, 2)
    return x.reshape(batch, kv_heads, group, padded,
                     *x.shape[5:])[:, :, :, :length]

  return unchunked(numerator), unchunked(denominator)


def linear_attention(query: Array, key: Array, value: Array,
                     bias: Array | None = None, mask: Array | None = None, *,
                     scale: float | None = None, is_causal: bool = False,
                     chunk_size: int | None = None) -> Array:
  """Linear attention with phi(x) = elu(x) + 1 (Katharopoulos et al. 2020),
  the features summed unshifted (see `_causal_sums` for the one case that
  loses: keys below about -87 in every component).

  Args:
    chunk_size: positions per chunk of causal attention (default:
      `default_chunk_size()`).
  """
  _check('linear', query, key, value, bias, mask, is_causal)
  if scale is not None:
    raise ValueError('linear attention has no logit scale; leave scale None.')
  query, key, value = (_heads_first(x) for x in (query, key, value))
  out = _attend(_elu_plus_one(query), _elu_plus_one(key), value, mask,
                is_causal=is_causal, chunk_size=chunk_size)
  return _heads_first(out).astype(query.dtype)


def _elu_plus_one(x: Array) -> Array:
  """elu(x) + 1 in float32 as e^min(x, 0) + max(x, 0): e^x exact where
  elu's expm1(x) + 1 rounds it to a multiple of 2^-24 (0 below x = -17)."""
  x = x.astype(jnp.float32)
  return jnp.exp(jnp.minimum(x, 0.0)) + jnp.maximum(x, 0.0)


def orthogonal_features(rng: Array, num_features: int, head_dim: int) -> Array:
  """[num_features, head_dim] Gaussian directions, orthogonal within each
  block of head_dim rows, with the norms of Gaussian vectors (Choromanski et
  al. 2021, the orthogonal random features of FAVOR+)."""
  num_blocks = -(-num_features // head_dim)
  gaussian = jax.random.normal(rng, (num_blocks, head_dim, head_dim))
  q, r = jnp.linalg.qr(gaussian)
  # Signs from R's diagonal make Q uniform (Haar) over orthogonal matrices;
  # without them the directions lean one way.
  q = q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[:, None, :]
  directions = jnp.swapaxes(q, -1, -2).reshape(-1, head_dim)[:num_features]
  norms = jnp.linalg.norm(jax.random.normal(
      jax.random.fold_in(rng, 1), (num_features, head_dim)), axis=-1)
  return directions * norms[:, None]


def performer_attention(query: Array, key: Array, value: Array,
                        bias: Array | None = None, mask: Array | None = None,
                        *, scale: float | None = None, is_causal: bool = False,
                        num_features: int = 256, seed: int = 0,
                        chunk_size: int | None = None) -> Array:
  """FAVOR+ (Choromanski et al. 2021): positive orthogonal random features
  whose inner products estimate the softmax kernel exp(scale * q . k), so
  the output estimates dense attention with an error that falls as
  `num_features` grows. The features are fixed by `seed`.
  """
  _check('performer', query, key, value, bias, mask, is_causal)
  if num_features < 1:
    raise ValueError(f'num_features={num_features} must be positive.')
  head_dim = query.shape[-1]
  scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
  projection = orthogonal_features(jax.random.key(seed), num_features,
                                   head_dim)

  def log_features(x):
    # w . x - |x|^2 / 2, with x scaled so that exp(.) / sqrt(m) has
    # E[phi(q) . phi(k)] = exp(scale * q . k).
    x = x.astype(jnp.float32) * math.sqrt(scale)
    projected = jnp.einsum('bntd,md->bntm', x, projection)
    return (projected - jnp.sum(x * x, axis=-1, keepdims=True) / 2
            - math.log(num_features) / 2)

  query, key, value = (_heads_first(x) for x in (query, key, value))
  # A shift per query cancels between numerator and denominator; the keys'
  # go with them.
  phi_q, _ = _relative_to_largest(log_features(query))
  phi_k, key_top = _relative_to_largest(log_features(key))
  out = _attend(phi_q, phi_k, value, mask, is_causal=is_causal,
                chunk_size=chunk_size, key_top=key_top)
  return _heads_first(out).astype(query.dtype)


# Hedgehog's feature maps of the projections x W [..., F], by the name the
# option `phi` takes.
HEDGEHOG_MAPS = {
    # Zhang et al. 2024: one softmax over both signs, 2F features.
    'hedgehog': lambda xw: jax.nn.softmax(
        jnp.concatenate([xw, -xw], axis=-1), axis=-1),
    # LoLCATs (Zhang et al. 2025): a softmax over each sign, 2F features.
    'lolcats': lambda xw: jnp.concatenate(
        [jax.nn.softmax(xw, axis=-1), jax.nn.softmax(-xw, axis=-1)], axis=-1),
    # The positive sign alone, F features.
    'one_sided': lambda xw: jax.nn.softmax(xw, axis=-1),
}


def hedgehog_attention(query: Array, key: Array, value: Array,
                       bias: Array | None = None, mask: Array | None = None,
                       *, scale: float | None = None,
                       is_causal: bool = False, feature_map: Array,
                       phi: str = 'hedgehog',
                       chunk_size: int | None = None) -> Array:
  """Linear attention whose feature map is learned (Zhang et al. 2024,
  "The Hedgehog & the Porcupine"): phi(x) = softmax([x W_k, -x W_k]), one
  softmax over 2F features, W_k [H, F] of key/value head k applied to its
  keys and to the queries of its group, so that phi(q) . phi(k) can be
  taught to imitate softmax attention's weights.

  Args:
    feature_map: W [K, H, F], one per key/value head (see `parameters`).
    phi: the map, one of HEDGEHOG_MAPS: 'hedgehog' (the paper's),
      'lolcats' ([softmax(x W_k), softmax(-x W_k)]) or 'one_sided'
      (softmax(x W_k)).
    chunk_size: positions per chunk of causal attention (default:
      `default_chunk_size()`).
  """
  _check('hedgehog', query, key, value, bias, mask, is_causal)
  if scale is not None:
    raise ValueError('hedgehog attention has no logit scale; leave scale '
                     'None.')
  if phi not in HEDGEHOG_MAPS:
    raise ValueError(f'phi={phi!r} must be one of '
                     f'{", ".join(map(repr, HEDGEHOG_MAPS))}.')
  batch, q_len, num_heads, head_dim = query.shape
  num_kv_heads = key.shape[2]
  if feature_map.ndim != 3 or feature_map.shape[:2] != (num_kv_heads,
                                                        head_dim):
    raise ValueError(f'feature_map {feature_map.shape} must be [K, H, F] '
                     f'with K = {num_kv_heads} key/value heads and H = '
                     f'{head_dim}.')
  weights = feature_map.astype(jnp.float32)
  grouped = query.astype(jnp.float32).reshape(
      batch, q_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
  features = HEDGEHOG_MAPS[phi]
  phi_q = features(jnp.einsum('btkgh,khf->bkgtf', grouped, weights))
  phi_k = features(
      jnp.einsum('bskh,khf->bksf', key.astype(jnp.float32), weights))
  out = _attend(phi_q.reshape(batch, num_heads, q_len, -1), phi_k,
                _heads_first(value), mask, is_causal=is_causal,
                chunk_size=chunk_size)
  return _heads_first(out).astype(query.dtype)


def hedgehog_parameters(module: nn.Module, config, *,
                        num_features: int | None = None,
                        **options) -> dict[str, Any]:
  """W [K, H, F], F = `num_features` (default H), created in `module` for
  a layer of `config` (a ModelConfig), starting as the identity on the
  first min(H, F) features (phi(x) = softmax([x, -x]) where F = H); with
  the other `options`, the keyword arguments of hedgehog_attention."""
  features = config.head_dim if num_features is None else num_features
  if features < 1:
    raise ValueError(f'num_features={num_features} must be positive.')

  def identity(rng, shape, dtype):
    del rng
    return jnp.broadcast_to(jnp.eye(shape[1], shape[2], dtype=dtype), shape)

  init = nn.with_logical_partitioning(identity, ('kv_heads', 'kv', None))
  return options | {'feature_map': module.param(
      'hedgehog_feature_map', init,
      (config.num_kv_heads, config.head_dim, features), config.weight_dtype)}
