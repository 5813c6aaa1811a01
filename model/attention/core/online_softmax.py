"""The online softmax (Milakov & Gimelshein 2018): softmax attention over
keys that arrive a chunk at a time, keeping per query a running maximum
logit, a running sum of exponentials and a running weighted sum of values.
Shared by `chunked` (chunks of keys in turn) and `ring` (blocks of keys
passed round the devices).
"""

import jax
import jax.numpy as jnp

Array = jax.Array


def split_heads(x: Array | None, num_kv_heads: int) -> Array | None:
  """[B, N, T, S]-broadcastable -> [B, K, G, T, S]-broadcastable."""
  if x is None:
    return None
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], num_kv_heads, -1, *x.shape[2:])


def sinks_by_group(sinks_N: Array | None, num_kv_heads: int
                   ) -> Array | None:
  """A sink logit per query head [N] as [1, K, G, 1]: what `init` takes
  for rows [B, K, G, T]."""
  if sinks_N is None:
    return None
  return sinks_N.astype(jnp.float32).reshape(1, num_kv_heads, -1, 1)


def init(shape: tuple[int, ...], head_dim: int, sinks: Array | None = None):
  """The online softmax of rows `shape` before any key: (running max, running
  sum of exponentials, running weighted sum of values [*shape, head_dim]);
  with `sinks` (broadcastable to `shape`), each row has seen one key of
  that logit and value zero already (core.sink_softmax)."""
  if sinks is None:
    return (jnp.full(shape, -jnp.inf), jnp.zeros(shape),
            jnp.zeros(shape + (head_dim,)))
  return (jnp.broadcast_to(sinks, shape), jnp.ones(shape),
          jnp.zeros(shape + (head_dim,)))


def step(stats, logits_BxKxGxTxC: Array, v_BxCxKxH: Array):
  """`stats` after one more chunk of keys: its masked logits (-inf where
  excluded) and its values."""
  row_max, row_sum, acc = stats
  new_max = jnp.maximum(row_max, jnp.max(logits_BxKxGxTxC, axis=-1))
  # Rows with nothing to attend yet keep a reference of 0, not -inf.
  reference = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
  rescale = jnp.exp(row_max - reference)
  weights = jnp.exp(logits_BxKxGxTxC - reference[..., None])
  row_sum = row_sum * rescale + jnp.sum(weights, axis=-1)
  acc = acc * rescale[..., None] + jnp.einsum(
      'bkgtc,bckh->bkgth', weights, v_BxCxKxH.astype(jnp.float32))
  return new_max, row_sum, acc


def result(stats) -> tuple[Array, Array]:
  """(output [B, K, G, T, H], log-sum-exp [B, K, G, T]) of the keys seen;
  rows that saw none give 0 and a log-sum-exp of +inf."""
  row_max, row_sum, acc = stats
  nonempty = row_sum > 0
  out = acc / jnp.where(nonempty, row_sum, 1.0)[..., None]
  reference = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  log_sum_exp = jnp.where(nonempty, reference + jnp.log(
      jnp.where(nonempty, row_sum, 1.0)), jnp.inf)
  return out, log_sum_exp
