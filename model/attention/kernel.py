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


def _shifted_max(x: Array, axes) -> Array:
  """The max of x over `axes` (kept), 0 where everything is -inf; a
  stabilizing shift, so no gradient flows through it."""
  top = jnp.max(x, axis=axes, keepdims=True)
  return jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))


def _attend(phi_q: Array, log_phi_k: Array, value: Array, mask: Array | None,
            *, is_causal: bool, chunk_size: int) -> Array:
  """sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j) over the allowed j.

  phi_q [B, T, N, F] and the log of the key features log_phi_k [B, S, K, F]
  (-inf where a feature is 0), value [B, S, K, H]; float32 out [B, T, N, H].
  Key features are exponentiated relative to a running maximum over the
  keys read so far (rescaling the running sums when it grows, as an online
  softmax does), so a large key cannot underflow the features of earlier
  chunks. A query with no allowed key gets zeros.
  """
  batch, q_len, num_heads, features = phi_q.shape
  kv_len, num_kv_heads, head_dim = value.shape[1:]
  value = value.astype(jnp.float32)
  if mask is not None:  # [B?, N?, 1, S]: drop the masked keys.
    if mask.shape[1] != 1 and num_kv_heads != num_heads:
      # A mask per query head: each head needs keys of its own.
      repeats = num_heads // num_kv_heads
      log_phi_k = jnp.repeat(log_phi_k, repeats, axis=2)
      value = jnp.repeat(value, repeats, axis=2)
      num_kv_heads = num_heads
    keep = jnp.broadcast_to(mask[:, :, 0], (batch, num_heads, kv_len))
    keep = keep.reshape(batch, num_kv_heads, -1, kv_len)[:, :, 0]
    log_phi_k = jnp.where(jnp.transpose(keep, (0, 2, 1))[..., None],
                          log_phi_k, -jnp.inf)
  group = num_heads // num_kv_heads
  phi_q = phi_q.reshape(batch, q_len, num_kv_heads, group, features)
  if not is_causal:
    phi_k = jnp.exp(log_phi_k - _shifted_max(log_phi_k, (1, 3)))
    state = jnp.einsum('bskf,bskh->bkfh', phi_k, value)
    total = jnp.sum(phi_k, axis=1)  # [B, K, F]
    numerator = jnp.einsum('btkgf,bkfh->btkgh', phi_q, state)
    denominator = jnp.einsum('btkgf,bkf->btkg', phi_q, total)
  else:
    chunk = min(chunk_size, q_len)
    padded = -(-q_len // chunk) * chunk
    pad = ((0, 0), (0, padded - q_len)) + ((0, 0),) * 2
    phi_q = jnp.pad(phi_q, pad + ((0, 0),))
    log_phi_k = jnp.pad(log_phi_k, pad, constant_values=-jnp.inf)
    value = jnp.pad(value, pad)
    chunks = padded // chunk

    def per_chunk(x):  # [B, T, ...] -> [chunks, B, chunk, ...]
      return jnp.moveaxis(x.reshape(batch, chunks, chunk, *x.shape[2:]), 1, 0)

    within = jnp.tril(jnp.ones((chunk, chunk), bool))

    def step(carry, xs):
      # Sums over earlier chunks, [B,K,F,H] and [B,K,F], in units of
      # exp(shift) [B,1,K,1].
      state, total, shift = carry
      q_c, log_k_c, v_c = xs
      new_shift = jnp.maximum(shift, _shifted_max(log_k_c, (1, 3)))
      rescale = jnp.exp(shift - new_shift)[:, 0]  # [B, K, 1]
      state, total = state * rescale[..., None], total * rescale
      k_c = jnp.exp(log_k_c - new_shift)
      scores = jnp.einsum('btkgf,bskf->bkgts', q_c, k_c)
      scores = jnp.where(within, scores, 0.0)
      numerator = (jnp.einsum('bkgts,bskh->btkgh', scores, v_c)
                   + jnp.einsum('btkgf,bkfh->btkgh', q_c, state))
      denominator = (jnp.einsum('bkgts->btkg', scores)
                     + jnp.einsum('btkgf,bkf->btkg', q_c, total))
      state = state + jnp.einsum('bskf,bskh->bkfh', k_c, v_c)
      total = total + jnp.sum(k_c, axis=1)
      return (state, total, new_shift), (numerator, denominator)

    init = (jnp.zeros((batch, num_kv_heads, features, head_dim)),
            jnp.zeros((batch, num_kv_heads, features)),
            jnp.full((batch, 1, num_kv_heads, 1), -jnp.inf))
    _, (numerator, denominator) = jax.lax.scan(
        step, init, (per_chunk(phi_q), per_chunk(log_phi_k),
                     per_chunk(value)))

    def unchunk(x):
      x = jnp.moveaxis(x, 0, 1)
      return x.reshape(batch, padded, *x.shape[3:])[:, :q_len]

    numerator, denominator = unchunk(numerator), unchunk(denominator)
  denominator = jnp.where(denominator > 0, denominator, 1.0)
  # Both divided by the denominator's value first, the division's gradient
  # (1 / denominator^2) stays finite where the features are tiny.
  unit = jax.lax.stop_gradient(denominator)
  out = (numerator / unit[..., None]) / (denominator / unit)[..., None]
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
  key = key.astype(jnp.float32)
  # log(elu(x) + 1): x below 0, log(1 + x) above.
  log_phi_k = jnp.where(key < 0, key, jnp.log1p(jnp.maximum(key, 0.0)))
  out = _attend(jax.nn.elu(query.astype(jnp.float32)) + 1.0, log_phi_k,
                value, mask, is_causal=is_causal, chunk_size=chunk_size)
  return out.astype(query.dtype)


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

  def log_features(x):
    # w . x - |x|^2 / 2, with x scaled so that exp(.) / sqrt(m) has
    # E[phi(q) . phi(k)] = exp(scale * q . k).
    x = x.astype(jnp.float32) * math.sqrt(scale)
    projected = jnp.einsum('bthd,md->bthm', x, projection)
    return (projected - jnp.sum(x * x, axis=-1, keepdims=True) / 2
            - math.log(num_features) / 2)

  # A shift per query cancels between numerator and denominator.
  log_phi_q = log_features(query)
  phi_q = jnp.exp(log_phi_q - _shifted_max(log_phi_q, -1))
  out = _attend(phi_q, log_features(key), value, mask, is_causal=is_causal,
                chunk_size=chunk_size)
  return out.astype(query.dtype)
