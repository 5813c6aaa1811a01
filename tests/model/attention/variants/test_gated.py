"""The gated linear-recurrent attentions (gated.py, recurrence.py) against
each paper's recurrence, written here as a float64 loop over positions."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention
from model.attention.variants import recurrence
from tests.helpers import tolerance
from tests.helpers.owned_parameters import owned

# Off every chunk size: 11 positions in chunks of 4.
B, T, N, K, D, CHUNK = 2, 11, 4, 2, 32, 4
H = D // N
GATED = ['deltanet', 'gated_deltanet', 'gla', 'mamba2', 'retnet']
# Packed rows: row 0 holds three documents, row 1 two.
SEGMENTS = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2],
                     [0] * 6 + [1] * 5])
# Key padding: row 0 drops two positions inside, row 1 its last three.
KEEP = np.ones((B, T), bool)
KEEP[0, [2, 6]] = False
KEEP[1, -3:] = False


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _softplus(x):
  return jnp.log1p(jnp.exp(x))


def papers_convolution(x, kernel, *, starts, keep):
  """SiLU of the causal convolution [B, T, C, H] of x by kernel [W, C, H]:
  position t's sum over the positions s = t - W + 1 .. t of its document,
  kernel[W - 1 - (t - s)] x_s, a dropped position's x read as 0."""
  width = kernel.shape[0]
  x = jnp.where(keep[..., None, None], x, 0.0)
  document = np.cumsum(starts, axis=1)
  outs = []
  for t in range(T):
    total = 0.0
    for s in range(max(0, t - width + 1), t + 1):
      same = (document[:, s] == document[:, t])[:, None, None]
      total = total + jnp.where(same, kernel[width - 1 - (t - s)] * x[:, s],
                                0.0)
    outs.append(total)
  return jax.nn.silu(jnp.stack(outs, axis=1))


def papers_recurrence(name, q, k, v, x, params, *, starts, keep):
  """float64 out [B, T, N, H] of attention `name`: the state S [F, H] per
  head updated position by position as its paper writes it, emptied at
  each document start, left as it was at a dropped position; out the
  RMS-normalised S^T q / sqrt(H). With short convolutions, q, k and v are
  their outputs."""
  if params.get('convolution') is not None:
    q, k, v = (papers_convolution(a, kernel, starts=starts, keep=keep)
               for a, kernel in zip((q, k, v), params['convolution']))
  k, v = (jnp.repeat(a, N // K, axis=2) for a in (k, v))
  delta = name in ('deltanet', 'gated_deltanet')
  if delta:
    # (+ 1e-12: a convolution's output is 0 where its window was dropped.)
    q, k = (a / jnp.sqrt(jnp.sum(a * a, -1, keepdims=True) + 1e-12)
            for a in (q, k))
  ones = jnp.ones((B, T, N, 1))
  if name == 'retnet':
    decay = ones * (1 - 2.0 ** (-5 - jnp.arange(N)))[:, None]
  elif name == 'gla':
    z = x @ params['gate_down'] @ params['gate_up'].reshape(16, N * H)
    decay = _sigmoid(z.reshape(B, T, N, H) + params['gate_bias']) ** (1 / 16)
  elif name in ('mamba2', 'gated_deltanet'):
    dt = _softplus(x @ params['dt_kernel'] + params['dt_bias'])
    decay = jnp.exp(-jnp.exp(params['a_log']) * dt)[..., None]
    if name == 'mamba2':  # Keys (B) discretised by dt.
      k = k * dt[..., None]
  else:
    decay = ones
  beta = _sigmoid(x @ params['beta_kernel']) if delta else None
  state = jnp.zeros((B, N, H, H))
  outs = []
  for t in range(T):
    fresh = starts[:, t][:, None, None, None]
    kept = keep[:, t][:, None, None, None]
    s = jnp.where(fresh, 0.0, state)
    a = decay[:, t][..., None]  # [B, N, F or 1, 1]
    kt, vt = k[:, t], v[:, t]  # [B, N, H]
    if delta:
      bt = beta[:, t][..., None, None]
      eye = jnp.eye(H)
      updated = (a * (eye - bt * kt[..., :, None] * kt[..., None, :]) @ s
                 + bt * kt[..., :, None] * vt[..., None, :])
    else:
      updated = a * s + kt[..., :, None] * vt[..., None, :]
    state = jnp.where(kept, updated, s)
    outs.append(jnp.einsum('bnfh,bnf->bnh', state, q[:, t]) / np.sqrt(H))
  out = jnp.stack(outs, axis=1)
  return out / jnp.sqrt(jnp.mean(out * out, -1, keepdims=True) + 1e-6)


def _inputs(seed):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(B, T, N, H)), rng.normal(size=(B, T, K, H)),
          rng.normal(size=(B, T, K, H)), rng.normal(size=(B, T, D)))


def _mask(case):
  if case == 'packed':
    return attention.SegmentMask(jnp.asarray(SEGMENTS))
  return jnp.asarray(KEEP)[:, None, None, :]


def _documents(case):
  starts = np.zeros((B, T), bool)
  if case == 'packed':
    starts[:, 1:] = SEGMENTS[:, 1:] != SEGMENTS[:, :-1]
  return starts, (KEEP if case == 'padded' else np.ones((B, T), bool))


# (name, case, conv_width): short convolutions of the papers' width 4 and
# of 3, across documents and around dropped positions.
CASES = ([(name, 'packed', 0) for name in GATED]
         + [('gla', 'padded', 0), ('gated_deltanet', 'padded', 0),
            ('mamba2', 'packed', 4), ('deltanet', 'padded', 3)])


@pytest.mark.parametrize('name, case, conv_width', CASES)
def test_the_chunked_form_equals_the_papers_recurrence(name, case,
                                                       conv_width):
  """Outputs and the gradients of q, k, v, the input x and the variant's
  parameters; the gradients of every position after the last one the loss
  reads are exactly zero (causality)."""
  options = {'conv_width': conv_width} if conv_width else {}
  params, _ = owned(name, d_model=D, num_heads=N, num_kv_heads=K, seed=3,
                    **options)
  q, k, v, x = (jnp.asarray(a, jnp.float32) for a in _inputs(0))
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, N, H)),
                          jnp.float32)
  last_read = 7
  cotangent = cotangent.at[:, last_read + 1:].set(0.0)
  fn = attention.get(name)
  mask = _mask(case)

  def ours(q, k, v, x, params):
    kwargs = params | ({'inputs': x} if attention.spec(name).reads_inputs
                       else {})
    out = fn(q, k, v, None, mask, is_causal=True, chunk_size=CHUNK, **kwargs)
    return out, jnp.sum(out * cotangent)

  out, grads = jax.jit(lambda *a: (ours(*a)[0], jax.grad(
      lambda *b: ours(*b)[1], argnums=(0, 1, 2, 3, 4))(*a)))(
          q, k, v, x, params)
  starts, keep = _documents(case)
  with jax.enable_x64(True):
    wide = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64),
                        (q, k, v, x, params, cotangent))

    def reference(q, k, v, x, params):
      return papers_recurrence(name, q, k, v, x, params, starts=starts,
                               keep=keep)

    want = reference(*wide[:5])
    want_grads = jax.grad(lambda *a: jnp.sum(reference(*a) * wide[5]),
                          argnums=(0, 1, 2, 3, 4))(*wide[:5])
    want, want_grads = jax.tree.map(np.asarray, (want, want_grads))
  valid = keep[:, :, None, None]  # A dropped position's output is unused.
  np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, want, 0),
                             **tolerance.FLOAT32)
  chex.assert_trees_all_close(grads, want_grads, **tolerance.KERNEL)
  for got in grads[:4]:
    np.testing.assert_array_equal(np.asarray(got)[:, last_read + 1:], 0.0)


@pytest.mark.parametrize('gates, delta', [(1, False), (H, False), (1, True)],
                         ids=['scalar_gate', 'gate_per_key_dim', 'delta'])
def test_the_chunked_form_equals_the_step_by_step_form(gates, delta):
  """From a given state, chunks of 1, 4 and more than the length: the same
  outputs and final state as decoding's steps."""
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=(B, N, T, H)), jnp.float32)
             for _ in range(3))
  if delta:
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  log_gate = jnp.asarray(-rng.uniform(0, 1, (B, N, T, gates)), jnp.float32)
  beta = jnp.asarray(rng.uniform(size=(B, N, T)), jnp.float32) if delta else None
  initial = jnp.asarray(rng.normal(size=(B, N, H, H)), jnp.float32)
  want = jax.jit(recurrence.steps)(q, k, v, log_gate, beta, initial=initial)
  chunked = jax.jit(recurrence.chunked, static_argnames='chunk')
  for chunk in (1, CHUNK, 16):
    got = chunked(q, k, v, log_gate, beta, initial=initial, chunk=chunk)
    chex.assert_trees_all_close(got, want, **tolerance.FLOAT32)


def test_the_initialisations_are_the_papers():
  heads = dict(d_model=D, num_heads=N, num_kv_heads=K)
  ssm, _ = owned('gated_deltanet', **heads)
  dt = jax.nn.softplus(ssm['dt_bias'])
  assert 1e-3 <= dt.min() and dt.max() <= 1e-1
  a = np.exp(ssm['a_log'])
  assert 1 <= a.min() and a.max() <= 16
  gla, _ = owned('gla', **heads)
  assert gla['gate_up'].shape == (16, N, H)
  np.testing.assert_array_equal(gla['gate_bias'], 0.0)


def test_a_recurrence_refuses_what_it_cannot_honour():
  q, k, v, _ = (jnp.asarray(a, jnp.float32) for a in _inputs(0))
  retnet = attention.get('retnet')
  with pytest.raises(ValueError, match='needs is_causal=True'):
    retnet(q, k, v)
  with pytest.raises(ValueError, match='key padding masks'):
    retnet(q, k, v, mask=jnp.ones((B, 1, T, T), bool), is_causal=True)
  with pytest.raises(ValueError, match='scalar gate per head'):
    recurrence.chunked(*(jnp.zeros((1, 1, 3, 2)),) * 3, jnp.zeros((1, 1, 3, 2)),
                       jnp.zeros((1, 1, 3)))


def test_the_unit_lower_inverse_is_the_inverse_on_and_off_a_power_of_two():
  rng = np.random.default_rng(0)
  for size in (1, 3, 8, 11):
    lower = np.tril(rng.normal(size=(2, size, size)), -1) * 0.5
    np.testing.assert_allclose(
        recurrence.unit_lower_inverse(jnp.asarray(lower, jnp.float32)),
        np.linalg.inv(np.eye(size) + lower), rtol=1e-5, atol=1e-5)


def test_per_dim_scores_by_sub_chunks_equal_the_formed_decays():
  """Chunks of 8 in sub-chunks of 2 (and one sub-chunk, 8 not dividing by
  3): the scores of the [C, C, F] decays, formed here in float64, under
  gates mild and so strong (log a = -40) that their decays underflow,
  with no overflow in the factors."""
  rng = np.random.default_rng(3)
  q, k = (rng.normal(size=(2, 3, 8, 5)) for _ in range(2))
  for scale in (1.0, 40.0):
    decay = np.cumsum(-scale * rng.uniform(size=(2, 3, 8, 5)), axis=-2)
    formed = np.exp(np.where(np.tril(np.ones((8, 8), bool))[..., None],
                             decay[..., :, None, :] - decay[..., None, :, :],
                             -np.inf))
    want = np.einsum('...tf,...sf,...tsf->...ts', q, k, formed)
    for sub_chunk in (2, 3):
      got = recurrence.per_dim_scores(
          *(jnp.asarray(x, jnp.float32) for x in (q, k, decay)),
          sub_chunk=sub_chunk)
      assert np.all(np.isfinite(got))
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
