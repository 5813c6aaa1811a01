"""Cross-entropy of vocabulary logits, a block of tokens at a time.

`readout_loss_sum` never holds float32 logits for more than one block of
tokens: each block's logits are computed from the model's `Readout`
(bfloat16 operands where the compute dtype is, float32 accumulation) and
reduced to per-token losses. Under differentiation the same pass also
takes each block's gradient (softmax less the target distribution, times
the token's weight) through the projection's two gradient matmuls, so the
backward pass only scales what the forward kept: three matmuls over the
vocabulary a step, where recomputing the logits in the backward pass
would take four (fused linear cross-entropy kernels, such as Liger's, do
the same). Forward-mode differentiation (jax.jvp) of the loss is not
defined. With label smoothing s the target distribution is (1 - s) on the
label plus s spread uniformly over the vocabulary (Szegedy et al. 2016);
with a z-loss z each token's loss adds z log^2 Z, Z the softmax's
normaliser (PaLM, Chowdhery et al. 2022), which keeps log Z near 0. Under
the readout's tanh cap (Readout.cap) the gradient passes through the cap's
derivative, 1 - (capped / cap)^2.
"""

import functools

import flax
import jax
import jax.numpy as jnp

from model.readout import Readout, project_gradients

Array = jax.Array

# The most float32 logits one block holds (2^26: 256 MiB over the batch);
# GPT-2's 8 x 1024 tokens x 50304 take 8 blocks, a byte vocabulary one.
MAX_BLOCK_LOGITS = 2 ** 26


@flax.struct.dataclass
class TokenLosses:
  """Per-target values, float32, the shape of the targets."""

  nll: Array  # -log p(label), nats.
  loss: Array  # The training loss: nll with label smoothing and z-loss.
  correct: Array  # 1.0 where no logit exceeds the label's (ties count).


def token_losses(logits_xV: Array, targets_x: Array,
                 label_smoothing: float = 0.0,
                 z_loss: float = 0.0) -> TokenLosses:
  """The losses of float32 logits [..., V] for integer targets [...]."""
  logits_xV = logits_xV.astype(jnp.float32)
  return _losses(logits_xV, jax.nn.log_softmax(logits_xV, axis=-1),
                 targets_x, label_smoothing, z_loss)


def _at_labels(x_xV: Array, targets_x: Array) -> Array:
  """x [..., V] at each target's index: [...]."""
  return jnp.take_along_axis(x_xV, targets_x[..., None], axis=-1)[..., 0]


def _losses(logits_xV: Array, log_probs_xV: Array, targets_x: Array,
            label_smoothing: float, z_loss: float) -> TokenLosses:
  """`token_losses` of float32 logits [..., V] and their log_softmax."""
  label_x = _at_labels(log_probs_xV, targets_x)
  label_logit_x = _at_labels(logits_xV, targets_x)
  nll_x = -label_x
  loss_x = nll_x
  if label_smoothing:
    loss_x = (1.0 - label_smoothing) * nll_x - label_smoothing * jnp.mean(
        log_probs_xV, axis=-1)
  if z_loss:  # log Z: any logit less its log-probability.
    loss_x = loss_x + z_loss * jnp.square(label_logit_x - label_x)
  # No logit above the label's: the maximum log_softmax takes already
  # (XLA computes it once), where an argmax would be another pass over V.
  correct_x = (label_logit_x >= jnp.max(logits_xV, axis=-1)).astype(
      jnp.float32)
  return TokenLosses(nll=nll_x, loss=loss_x, correct=correct_x)


def num_blocks(batch: int, length: int, vocab: int) -> int:
  """The fewest blocks, a divisor of `length`, whose logits [batch,
  length / blocks, vocab] hold at most MAX_BLOCK_LOGITS each."""
  for blocks in range(1, length + 1):
    if length % blocks == 0 and (batch * (length // blocks) * vocab
                                 <= MAX_BLOCK_LOGITS):
      return blocks
  return length


def _split(x_BxTx: Array, blocks: int) -> Array:
  """[B, T, ...] -> [blocks, B, T / blocks, ...]: block k holds positions
  k, k + blocks, ..., so that a split of the length over devices (sequence
  parallelism) splits every block the same way."""
  batch, length = x_BxTx.shape[:2]
  x = x_BxTx.reshape(batch, length // blocks, blocks, *x_BxTx.shape[2:])
  return jnp.moveaxis(x, 2, 0)


def _join(x_NxBxCx: Array) -> Array:
  """`_split`'s inverse: [blocks, B, C, ...] -> [B, blocks * C, ...]."""
  blocks, batch, chunk = x_NxBxCx.shape[:3]
  return jnp.moveaxis(x_NxBxCx, 0, 2).reshape(batch, blocks * chunk,
                                              *x_NxBxCx.shape[3:])


def _blockwise(readout: Readout, targets_BxT: Array, weights_BxT: Array,
               label_smoothing: float, z_loss: float, gradients: bool):
  """(sum of loss x weight [], TokenLosses [B, T]) of the readout's
  logits for targets [B, T] weighted [B, T], a block of positions at a
  time; with `gradients`, also the sum's gradient with respect to the
  readout (a Readout of gradients: hidden states [B, T, D], weights, and
  bias [V] or None)."""
  batch, length = targets_BxT.shape
  vocab = readout.vocab_size
  blocks = num_blocks(batch, length, vocab)

  def block(carry, xs):
    """One block of C positions: the sums so far (loss; with gradients,
    the weights' and the bias's) -> the sums with it, and its losses (and
    hidden states' gradient [B, C, D])."""
    hidden_BxCxD, targets_BxC, weights_BxC = xs
    logits_BxCxV = readout.logits(hidden_BxCxD)
    log_probs_BxCxV = jax.nn.log_softmax(logits_BxCxV, axis=-1)
    losses = _losses(logits_BxCxV, log_probs_BxCxV, targets_BxC,
                     label_smoothing, z_loss)
    total = carry[0] + jnp.sum(losses.loss * weights_BxC)
    if not gradients:
      return (total,), losses
    # d loss / d logits: softmax less the target distribution; the z-loss
    # adds 2 z log Z softmax.
    target_BxCxV = (1.0 - label_smoothing) * jax.nn.one_hot(
        targets_BxC, vocab, dtype=jnp.float32) + label_smoothing / vocab
    probs_BxCxV = jnp.exp(log_probs_BxCxV)
    if z_loss:  # As in _losses: the label's logit less its log-probability.
      log_z_BxC = _at_labels(logits_BxCxV, targets_BxC) + losses.nll
      probs_BxCxV = probs_BxCxV * (1.0 + 2.0 * z_loss * log_z_BxC)[..., None]
    d_logits_BxCxV = (probs_BxCxV - target_BxCxV) * weights_BxC[..., None]
    if readout.cap:  # Through the cap: logits here are capped ones.
      d_logits_BxCxV = d_logits_BxCxV * (
          1.0 - jnp.square(logits_BxCxV / readout.cap))
    d_hidden_BxCxD, d_weights = project_gradients(
        hidden_BxCxD, readout.weights, readout.weights_spec,
        readout.compute_dtype, d_logits_BxCxV / readout.divisor)
    carry = (total, carry[1] + d_weights,
             None if readout.bias_V is None else
             carry[2] + jnp.sum(d_logits_BxCxV, axis=(0, 1)))
    return carry, (losses, d_hidden_BxCxD)

  # Zeros that vary over whatever mesh axes the inputs vary over inside
  # jax.shard_map (zeros_like follows its example), as the sums added to
  # them do: a scan's carry keeps its type.
  anchor = sum(jnp.zeros_like(x, jnp.float32, shape=()) for x in
               jax.tree.leaves((readout, targets_BxT, weights_BxT)))

  def zeros(*shape):
    return jnp.zeros_like(anchor, shape=shape)

  carry = (zeros(),) if not gradients else (
      zeros(), zeros(*readout.weights.shape),
      None if readout.bias_V is None else zeros(vocab))
  carry, outputs = jax.lax.scan(
      block, carry, tuple(_split(x, blocks) for x in (
          readout.hidden_BxTxD, targets_BxT, weights_BxT)))
  if not gradients:
    return carry[0], jax.tree.map(_join, outputs)
  losses, d_hidden_NxBxCxD = outputs
  grads = readout.replace(
      hidden_BxTxD=_join(d_hidden_NxBxCxD),
      weights=carry[1].astype(readout.weights.dtype),
      bias_V=None if readout.bias_V is None else
      carry[2].astype(readout.bias_V.dtype))
  return carry[0], jax.tree.map(_join, losses), grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _loss_sum(readout: Readout, targets_BxT: Array, weights_BxT: Array,
              label_smoothing: float, z_loss: float
              ) -> tuple[Array, TokenLosses]:
  """`readout_loss_sum` without stopping the losses' gradient; its
  gradient is `_loss_sum_forward`'s, scaled."""
  return _blockwise(readout, targets_BxT, weights_BxT, label_smoothing,
                    z_loss, gradients=False)


def _loss_sum_forward(readout, targets_BxT, weights_BxT, label_smoothing,
                      z_loss):
  """The values, and as residuals the sum's gradients: the readout's, and
  the weights' (each token's loss)."""
  total, losses, grads = _blockwise(readout, targets_BxT, weights_BxT,
                                    label_smoothing, z_loss, gradients=True)
  return (total, losses), (grads, losses.loss)


def _loss_sum_backward(_, __, residuals, cotangents):
  """The readout's and the weights' gradients times the sum's cotangent;
  none for the integer targets. The per-token losses' cotangents are
  zero: `readout_loss_sum` stops their gradient."""
  grads, loss_BxT = residuals
  d_total = cotangents[0]
  return (jax.tree.map(lambda g: (g * d_total).astype(g.dtype), grads),
          None, loss_BxT * d_total)


_loss_sum.defvjp(_loss_sum_forward, _loss_sum_backward)


def readout_loss_sum(readout: Readout, targets_BxT: Array,
                     weights_BxT: Array, label_smoothing: float = 0.0,
                     z_loss: float = 0.0) -> tuple[Array, TokenLosses]:
  """(sum over tokens of loss x weight, the TokenLosses [B, T]) of
  `token_losses(readout.logits(), targets_BxT, label_smoothing, z_loss)`,
  computed a block of positions at a time: float32 logits of one block at
  most. The sum is differentiable with respect to the readout (its
  gradient taken with the forward pass where the logits take several
  blocks; in one block, autodiff's backward pass recomputes nothing
  already) and to the weights (each token's loss); the per-token losses
  are values only (no gradient flows through them)."""
  weights_BxT = weights_BxT.astype(jnp.float32)
  if num_blocks(*targets_BxT.shape, readout.vocab_size) == 1:
    losses = token_losses(readout.logits(), targets_BxT, label_smoothing,
                          z_loss)
    total = jnp.sum(losses.loss * weights_BxT)
  else:
    total, losses = _loss_sum(readout, targets_BxT, weights_BxT,
                              label_smoothing, z_loss)
  return total, jax.lax.stop_gradient(losses)
