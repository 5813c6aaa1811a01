"""Kernelised (linear-time) attention: `linear` and `performer`.

softmax(q k^T) is replaced by a feature map phi with phi(q) . phi(k) as the
similarity, so attention regroups as phi(q) (sum_j phi(k_j) v_j^T): O(T)
in the sequence length. Causal attention keeps running sums over the keys;
they are computed a chunk of positions at a time (quadratic only inside a
chunk), so memory is O(T * (chunk + F * H / chunk)) rather than the
O(T * F * H) of a plain prefix sum.
"""

import math

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


def _attend(phi_q: Array, phi_k: Array, value: Array, mask: Array | None, *,
            is_causal: bool, chunk_size: int) -> Array:
  """sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j) over the allowed j.

  phi_q [B, T, N, F], phi_k [B, S, K, F], value [B, S, K, H]; float32 out
  [B, T, N, H]. A query with no allowed key gets zeros.
  """
  batch, q_len, num_heads, features = phi_q.shape
  kv_len, num_kv_heads, head_dim = value.shape[1], value.shape[2], value.shape[3]
  group = num_heads // num_kv_heads
  value = value.astype(jnp.float32)
  if mask is not None:  # [B?, N?, 1, S] -> zero the masked keys' features.
    keep = jnp.broadcast_to(mask, (batch, num_heads, 1, kv_len))
    keep = keep.reshape(batch, num_kv_heads, group, kv_len)[:, :, 0]
    phi_k = phi_k * jnp.transpose(keep, (0, 2, 1))[..., None]
  phi_q = phi_q.reshape(batch, q_len, num_kv_heads, group, features)
  if not is_causal:
    state = jnp.einsum('bskf,bskh->bkfh', phi_k, value)
    total = jnp.sum(phi_k, axis=1)  # [B, K, F]
    numerator = jnp.einsum('btkgf,bkfh->btkgh', phi_q, state)
    denominator = jnp.einsum('btkgf,bkf->btkg', phi_q, total)
  else:
    chunk = min(chunk_size, q_len)
    padded = -(-q_len // chunk) * chunk
    pad = ((0, 0), (0, padded - q_len)) + ((0, 0),) * 2
    phi_q = jnp.pad(phi_q, pad + ((0, 0),))
    phi_k, value = jnp.pad(phi_k, pad), jnp.pad(value, pad)
    chunks = padded // chunk

    def per_chunk(x):  # [B, T, ...] -> [chunks, B, chunk, ...]
      return jnp.moveaxis(x.reshape(batch, chunks, chunk, *x.shape[2:]), 1, 0)

    within = jnp.tril(jnp.ones((chunk, chunk), bool))

    def step(carry, xs):
      state, total = carry  # Sums over earlier chunks: [B,K,F,H], [B,K,F].
      q_c, k_c, v_c = xs
      scores = jnp.einsum('btkgf,bskf->bkgts', q_c, k_c)
      scores = jnp.where(within, scores, 0.0)
      numerator = (jnp.einsum('bkgts,bskh->btkgh', scores, v_c)
                   + jnp.einsum('btkgf,bkfh->btkgh', q_c, state))
      denominator = (jnp.einsum('bkgts->btkg', scores)
                     + jnp.einsum('btkgf,bkf->btkg', q_c, total))
      state = state + jnp.einsum('bskf,bskh->bkfh', k_c, v_c)
      total = total + jnp.sum(k_c, axis=1)
      return (state, total), (numerator, denominator)

    init = (jnp.zeros((batch, num_kv_heads, features, head_dim)),
            jnp.zeros((batch, num_kv_heads, features)))
    _, (numerator, denominator) = jax.lax.scan(
        step, init, (per_chunk(phi_q), per_chunk(phi_k), per_chunk(value)))

    def unchunk(x):
      x = jnp.moveaxis(x, 0, 1)
      return x.reshape(batch, padded, *x.shape[3:])[:, :q_len]

    numerator, denominator = unchunk(numerator), unchunk(denominator)
  out = numerator / jnp.where(denominator > 0, denominator, 1.0)[..., None]
  return out.reshape(batch, q_len, num_heads, head_dim)


def linear_attention(query: Array, key: Array, value: Array,
                     bias: Array | None = None, mask: Array | None = None, *,
                     scale: float | None = None, is_causal: bool = False,
                     chunk_size: int = 64) -> Array:
  """Linear attention with phi(x) = elu(x) + 1 (Katharopoulos et al. 2020).

  Args:
    chunk_size: positions per chunk of the causal running sums.
  """
  _check('linear', query, key, value, bias, mask, is_causal)
  if scale is not None:
    raise ValueError('linear attention has no logit scale; leave scale None.')
  feature_map = lambda x: jax.nn.elu(x.astype(jnp.float32)) + 1.0
  out = _attend(feature_map(query), feature_map(key), value, mask,
                is_causal=is_causal, chunk_size=chunk_size)
  return out.astype(query.dtype)


def orthogonal_features(rng: Array, num_features: int, head_dim: int) -> Array:
  """[num_features, head_dim] Gaussian directions, orthogonal within each
  block of head_dim rows, with the norms of Gaussian vectors (Choromanski et
  al. 2021, the orthogonal random features of FAVOR+)."""
  blocks = []
  for block_rng in jax.random.split(rng, -(-num_features // head_dim)):
    gaussian = jax.random.normal(block_rng, (head_dim, head_dim))
    q, _ = jnp.linalg.qr(gaussian)
    blocks.append(q.T)
  directions = jnp.concatenate(blocks)[:num_features]
  norms = jnp.linalg.norm(jax.random.normal(
      jax.random.fold_in(rng, 1), (num_features, head_dim)), axis=-1)
  return directions * norms[:, None]


def performer_attention(query: Array, key: Array, value: Array,
                        bias: Array | None = None, mask: Array | None = None,
                        *, scale: float | None = None, is_causal: bool = False,
                        num_features: int = 256, seed: int = 0,
                        chunk_size: int = 64) -> Array:
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

  def features(x, stabilizer_axes):
    # exp(w . x - |x|^2 / 2) / sqrt(m), with x scaled so that
    # E[phi(q) . phi(k)] = exp(scale * q . k).
    x = x.astype(jnp.float32) * math.sqrt(scale)
    projected = jnp.einsum('bthd,md->bthm', x, projection)
    exponent = projected - jnp.sum(x * x, axis=-1, keepdims=True) / 2
    # A constant shift cancels between numerator and denominator.
    shift = jax.lax.stop_gradient(
        jnp.max(exponent, axis=stabilizer_axes, keepdims=True))
    return jnp.exp(exponent - shift) / math.sqrt(num_features)

  # Queries may shift per query; keys only by one constant per head.
  phi_q = features(query, stabilizer_axes=-1)
  phi_k = features(key, stabilizer_axes=(1, 3))
  out = _attend(phi_q, phi_k, value, mask, is_causal=is_causal,
                chunk_size=chunk_size)
  return out.astype(query.dtype)
