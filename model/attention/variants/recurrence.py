"""The gated linear recurrence, with or without the delta rule: the one
mechanism under retnet, mamba2, gla, deltanet and gated_deltanet
(gated.py gives each its gate and its parameters).

Per head, a state S_t [F, H] (key dims F, value dims H) runs over the
positions and is read by each query:

  gated linear:  S_t = a_t * S_{t-1} + k_t v_t^T
  delta rule:    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T
  output:        o_t = S_t^T q_t

with a_t = exp(log_gate_t) in (0, 1], a scalar per head or one per key
dim (acting on S's rows), and b_t in [0, 1] the delta rule's step (Schlag
et al. 2021; Yang et al. 2024). A document start empties the state
(a_t = 0 there), so no state crosses a packed boundary.

Two forms compute it:
- `chunked`, for training and prompts (Yang et al. 2024's chunkwise form;
  Mamba-2's SSD): per chunk of C positions, the pairs inside it as [C, C]
  matrices of decays, and the state of the chunks before it. With a gate
  alone, every chunk's state comes at once from a parallel scan over the
  chunks (O(log(T / C)) dependent steps). The delta rule's corrections
  inside a chunk are one unit lower-triangular system,
  (I + A) [U, W] = [b v, b a k] (the UT form of the WY representation,
  Yang et al. 2024), solved by `unit_lower_inverse`, and its states pass
  from chunk to chunk (T / C steps of [C, F] x [F, H] products, as
  flash-linear-attention's kernels run them). Work O(T C (F + H) + T F H),
  memory O(T) at a fixed chunk.
- `steps`, one position at a time from a state: what decoding carries,
  constant in T.

Decays are only ever formed as exp(b_t - b_s) with s <= t (b the running
sum of log gates inside a chunk), never as exp(b_t) / exp(b_s): each is at
most 1, so nothing overflows, and a decay that underflows to 0 is below
float32's least number anyway.
"""

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def _chunks(x: Array, chunk: int) -> Array:
  """[B, N, T, ...] -> [B, N, n, C, ...], zero-padded to n * C positions."""
  length = x.shape[2]
  padded = -(-length // chunk) * chunk
  pad = [(0, 0)] * x.ndim
  pad[2] = (0, padded - length)
  x = jnp.pad(x, pad)
  return x.reshape(*x.shape[:2], padded // chunk, chunk, *x.shape[3:])


def _multiply(earlier, later):
  """Two chunks' transitions S -> m * S + R (m [..., G] on S's rows,
  R [..., F, H]): the later applied after the earlier."""
  (m_a, r_a), (m_b, r_b) = earlier, later
  return m_b * m_a, m_b[..., None] * r_a + r_b


def unit_lower_inverse(strictly_lower: Array) -> Array:
  """(I + L)^-1 [..., C, C] for L strictly lower triangular [..., C, C].

  By doubling: the inverses of the diagonal blocks of size s give those of
  size 2 s, [[A, 0], [X, B]]^-1 = [[A^-1, 0], [-B^-1 X A^-1, B^-1]], so each
  block formed is a block of the exact inverse (forward substitution's
  accuracy) and all the work is log2(C) rounds of batched matmuls: what a
  GPU's or TPU's matrix units run best, with no triangular solve to call
  (XLA's CPU one, LAPACK's, can deadlock when two run at once on a
  2-thread pool).
  """
  size = strictly_lower.shape[-1]
  padded = 1 << (size - 1).bit_length()
  pad = [(0, 0)] * (strictly_lower.ndim - 2) + [(0, padded - size)] * 2
  lower = jnp.pad(strictly_lower, pad)
  lead = lower.shape[:-2]
  inverse = jnp.ones((*lead, padded, 1, 1), lower.dtype)  # [.., n, s, s]
  block = 1
  while block < padded:
    pairs = padded // (2 * block)
    diagonal = jnp.diagonal(
        lower.reshape(*lead, pairs, 2 * block, pairs, 2 * block),
        axis1=-4, axis2=-2)  # [.., 2 s, 2 s, pairs]
    below = jnp.moveaxis(diagonal, -1, -3)[..., block:, :block]
    first, second = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
    corner = -(second @ below @ first)
    inverse = jnp.concatenate([
        jnp.concatenate([first, jnp.zeros_like(first)], -1),
        jnp.concatenate([corner, second], -1)], -2)
    block *= 2
  return inverse[..., 0, :size, :size]


def default_sub_chunk(chunk: int) -> int:
  """`per_dim_scores`' sub-chunk for chunks of `chunk` positions: the
  power of two nearest sqrt(chunk), the larger at a tie (8 of 64, 16 of
  128). Its temporaries per position, c decays formed inside a sub-chunk
  and C / c products between sub-chunks (each [F]), are fewest there; the
  matmul work between sub-chunks, C^2 F a chunk, is the same for any c.
  At 4096 tokens on this CPU (8 heads of 64, forward and backward), 8 of
  64 against 16: 425 ms against 542, temporaries 571 MB against 845."""
  return 2 ** math.ceil(math.log2(chunk) / 2)


def per_dim_scores(q: Array, k: Array, decay: Array,
                   sub_chunk: int | None = None) -> Array:
  """sum_f q_tf k_sf exp(b_tf - b_sf) for s <= t inside each chunk
  ([..., C, F] each, b = `decay` the running sum of log gates; [..., C (t),
  C (s)], zero above the diagonal), without forming the [C, C, F]
  decays (GLA's secondary chunking, Yang et al. 2024). Between sub-chunks
  i > j of `sub_chunk` positions the decay factors as exp(b_t - e_{i-1})
  exp(e_{i-1} - e_j) exp(e_j - b_s), e_j the running sum at the end of
  sub-chunk j: each at most 1, the first on the queries, the last on the
  keys and the middle a vector per pair of sub-chunks, so their scores are
  matmuls; inside a sub-chunk the decays are formed, [c, c, F]. None:
  default_sub_chunk(C); one that does not divide C, the whole chunk."""
  chunk, features = q.shape[-2:]
  sub_chunk = sub_chunk or default_sub_chunk(chunk)
  c = sub_chunk if chunk % sub_chunk == 0 else chunk
  m = chunk // c
  split = lambda x: x.reshape(*x.shape[:-2], m, c, features)
  q, k, b = split(q), split(k), split(decay)  # [..., m, c, F]
  within = jnp.tril(jnp.ones((c, c), bool))[..., None]
  diagonal = jnp.einsum('...itf,...isf,...itsf->...its', q, k, jnp.exp(
      jnp.where(within, b[..., :, None, :] - b[..., None, :, :], -jnp.inf)))
  ends = b[..., -1, :]  # e_j [..., m, F]
  # e_{i-1}, the reference of query sub-chunk i (none for the first).
  before = jnp.concatenate([jnp.zeros_like(ends[..., :1, :]),
                            ends[..., :-1, :]], axis=-2)
  earlier = jnp.tril(jnp.ones((m, m), bool), -1)[..., None]
  between = jnp.exp(jnp.where(
      earlier, before[..., :, None, :] - ends[..., None, :, :], -jnp.inf))
  q_scaled = q * jnp.exp(b - before[..., None, :])
  k_scaled = k * jnp.exp(ends[..., None, :] - b)
  off = jnp.einsum('...itf,...ijf,...jsf->...itjs', q_scaled, between,
                   k_scaled)
  # Sub-chunk i's own block where j == i, the factored ones elsewhere.
  scores = jnp.where(jnp.eye(m, dtype=bool)[:, None, :, None],
                     diagonal[..., None, :], off)
  return scores.reshape(*scores.shape[:-4], chunk, chunk)


def chunked(query: Array, key: Array, value: Array, log_gate: Array,
            beta: Array | None = None, *, starts: Array | None = None,
            initial: Array | None = None, chunk: int = 64
            ) -> tuple[Array, Array]:
  """(outputs [B, N, T, H], the state after the last position [B, N, F, H]),
  float32, of the recurrence in the module docstring.

  Heads first: query, key [B, N, T, F], value [B, N, T, H]; log_gate
  [B, N, T, G], log a_t <= 0, with G = 1 (a scalar per head) or G = F;
  beta [B, N, T] in [0, 1] for the delta rule (then G = 1), None for the
  gated linear recurrence; starts [B, T], True where a document starts (the
  state before it is dropped), None for one document a row; initial
  [B, N, F, H], the state before the first position (None: zeros).
  """
  batch, heads, length, features = key.shape
  if beta is not None and log_gate.shape[-1] != 1:
    raise ValueError('the delta rule takes a scalar gate per head, not '
                     f'log_gate of shape {log_gate.shape}.')
  if chunk < 1:
    raise ValueError(f'chunk={chunk} must be positive.')
  chunk = min(chunk, length)
  f32 = jnp.float32
  q, k, v, g = (_chunks(x.astype(f32), chunk)
                for x in (query, key, value, log_gate))
  decay = jnp.cumsum(g, axis=3)  # b_t [B, N, n, C, G], inclusive.
  causal = jnp.tril(jnp.ones((chunk, chunk), bool))
  if starts is None:
    count = jnp.zeros((1, 1, 1, chunk), jnp.int32)
  else:  # Document starts so far in the chunk, [B, 1, n, C].
    count = jnp.cumsum(_chunks(starts[:, None].astype(jnp.int32), chunk),
                       axis=3)
  # Pairs s <= t of one document.
  same = causal & (count[..., :, None] == count[..., None, :])
  # What reaches position t from the state before the chunk, [.., C, G]...
  from_before = jnp.exp(decay) * (count == 0)[..., None]
  # ... and what reaches the chunk's end: from before it [.., G], and from
  # each of its positions, as keys weighted by it [.., C, F].
  last = decay[..., -1:, :]
  through = jnp.exp(last[..., 0, :]) * (count[..., -1] == 0)[..., None]
  to_end = (count == count[..., -1:])[..., None]
  k_to_end = k * jnp.exp(last - decay) * to_end
  if log_gate.shape[-1] == 1:
    # The decay between each pair, [B, N, n, C (t), C (s)].
    pair_decay = jnp.exp(jnp.where(
        same, decay[..., :, None, 0] - decay[..., None, :, 0], -jnp.inf))
    scores = jnp.einsum('...tf,...sf->...ts', q, k) * pair_decay
  else:
    scores = jnp.where(same, per_dim_scores(q, k, decay), 0.0)
  if beta is None:  # The state takes in the values as they are.
    new_values = v
  else:
    # u_t = b_t (v_t - a_t S_{t-1}^T k_t) enters the state as k_t u_t^T;
    # with S_0 the state before the chunk, U = U0 - W S_0, where
    # (I + A) [U0, W] = [b v, b a k], A_ts = b_t decay_ts k_t . k_s (s < t).
    b = _chunks(beta[..., None].astype(f32), chunk)
    strictly = jnp.einsum('...tf,...sf->...ts', k, k) * pair_decay
    lower = b * jnp.where(causal & ~jnp.eye(chunk, dtype=bool), strictly, 0.0)
    solved = unit_lower_inverse(lower) @ jnp.concatenate(
        [b * v, b * from_before * k], -1)
    new_values, from_state = (solved[..., :v.shape[-1]],
                              solved[..., v.shape[-1]:])
  start = (jnp.zeros((batch, heads, features, v.shape[-1]), f32)
           if initial is None else initial.astype(f32))
  if beta is None:
    # Every chunk's end state from the first position, M_n ... M_1 S_0 + R
    # with M_n diagonal, by a parallel scan over the chunks.
    transition = (through, jnp.einsum('...sf,...sh->...fh', k_to_end, v))
    across, added = jax.lax.associative_scan(_multiply, transition, axis=2)
    ends = across[..., None] * start[:, :, None] + added
    before = jnp.concatenate([start[:, :, None], ends[:, :, :-1]], axis=2)
    final = ends[:, :, -1]
  else:
    # One chunk after another: a parallel scan would compose the delta
    # rule's [F, F] transitions, F / C times the work.
    def next_chunk(state, chunk_inputs):
      through_n, k_to_end_n, values_n, from_state_n = chunk_inputs
      entering = values_n - from_state_n @ state
      return (through_n[..., None] * state
              + jnp.swapaxes(k_to_end_n, -1, -2) @ entering), state

    final, before = jax.lax.scan(next_chunk, start, tuple(
        jnp.moveaxis(x, 2, 0)
        for x in (through, k_to_end, new_values, from_state)))
    before = jnp.moveaxis(before, 0, 2)
    new_values = new_values - from_state @ before
  # What the state before the chunk gives plus what the chunk's own
  # positions give, as one product [C, F + C] x [F + C, H].
  out = (jnp.concatenate([q * from_before, scores], -1)
         @ jnp.concatenate([before, new_values], -2))
  out = out.reshape(batch, heads, -1, v.shape[-1])[:, :, :length]
  return out, final


def steps(query: Array, key: Array, value: Array, log_gate: Array,
          beta: Array | None = None, *, initial: Array | None = None
          ) -> tuple[Array, Array]:
  """`chunked`'s outputs and final state for one document a row, one
  position at a time (lax.scan): what decoding carries from a token to the
  next, a state of constant size."""
  batch, heads, _, features = key.shape
  state = (jnp.zeros((batch, heads, features, value.shape[-1]), jnp.float32)
           if initial is None else initial.astype(jnp.float32))

  def step(state, inputs):
    q, k, v, g, b = inputs  # [B, N, F], .., [B, N, H], [B, N, G], [B, N]
    gate = jnp.exp(g)[..., None]
    if b is None:
      state = gate * state + k[..., None] * v[..., None, :]
    else:
      correction = v - jnp.einsum('bnf,bnfh->bnh', k, gate * state)
      state = gate * state + k[..., None] * (b[..., None] * correction)[
          ..., None, :]
    return state, jnp.einsum('bnf,bnfh->bnh', q, state)

  inputs = [jnp.moveaxis(x.astype(jnp.float32), 2, 0)
            for x in (query, key, value, log_gate)]
  inputs.append(None if beta is None
                else jnp.moveaxis(beta.astype(jnp.float32), 2, 0))
  state, out = jax.lax.scan(step, state, tuple(inputs))
  return jnp.moveaxis(out, 0, 2), state
