"""Cross-entropy of vocabulary logits, a block of tokens at a time.

`readout_losses` never holds float32 logits for more than one block of
tokens: each block's logits are computed from the model's `Readout`
(bfloat16 operands where the compute dtype is, float32 accumulation), reduced
to per-token losses, and recomputed in the backward pass rather than kept
(as large-vocabulary trainers do). With label smoothing s the target
distribution is (1 - s) on the label plus s spread uniformly over the
vocabulary (Szegedy et al. 2016).
"""

import flax
import jax
import jax.numpy as jnp

from model.readout import Readout

Array = jax.Array

# The most float32 logits one block holds (2^26: 256 MiB over the batch);
# GPT-2's 8 x 1024 tokens x 50304 take 8 blocks, a byte vocabulary one.
MAX_BLOCK_LOGITS = 2 ** 26


@flax.struct.dataclass
class TokenLosses:
  """Per-target values, float32, the shape of the targets."""

  nll: Array  # -log p(label), nats.
  loss: Array  # The training loss: nll with label smoothing applied.
  correct: Array  # 1.0 where no logit exceeds the label's (ties count).


def token_losses(logits_xV: Array, targets_x: Array,
                 label_smoothing: float = 0.0) -> TokenLosses:
  """The losses of float32 logits [..., V] for integer targets [...]."""
  logits_xV = logits_xV.astype(jnp.float32)
  log_probs_xV = jax.nn.log_softmax(logits_xV, axis=-1)
  label_x = jnp.take_along_axis(log_probs_xV, targets_x[..., None],
                                axis=-1)[..., 0]
  nll_x = -label_x
  loss_x = nll_x
  if label_smoothing:
    loss_x = (1.0 - label_smoothing) * nll_x - label_smoothing * jnp.mean(
        log_probs_xV, axis=-1)
  # No logit above the label's: the maximum log_softmax takes already
  # (XLA computes it once), where an argmax would be another pass over V.
  label_logit_x = jnp.take_along_axis(logits_xV, targets_x[..., None],
                                      axis=-1)[..., 0]
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


def readout_losses(readout: Readout, targets_BxT: Array,
                   label_smoothing: float = 0.0) -> TokenLosses:
  """`token_losses(readout.logits(), targets_BxT, label_smoothing)`,
  computed a block of positions at a time: float32 logits of one block at
  most, forward and backward."""
  hidden_BxTxD = readout.hidden_BxTxD
  batch, length = targets_BxT.shape
  blocks = num_blocks(batch, length, readout.vocab_size)

  def block_losses(hidden_BxCxD, targets_BxC):
    return token_losses(readout.logits(hidden_BxCxD), targets_BxC,
                        label_smoothing)

  if blocks == 1:
    return block_losses(hidden_BxTxD, targets_BxT)

  def split(x_BxTx):
    # [B, T, ...] -> [blocks, B, T / blocks, ...]: block k holds positions
    # k, k + blocks, ..., so that a split of the length over devices
    # (sequence parallelism) splits every block the same way.
    x = x_BxTx.reshape(batch, length // blocks, blocks, *x_BxTx.shape[2:])
    return jnp.moveaxis(x, 2, 0)

  # Recomputed in the backward pass: nothing of [B, C, V] is kept.
  recomputed = jax.checkpoint(block_losses)
  _, losses = jax.lax.scan(lambda _, xs: (None, recomputed(*xs)), None,
                           (split(hidden_BxTxD), split(targets_BxT)))
  return jax.tree.map(
      lambda x_NxBxC: jnp.moveaxis(x_NxBxC, 0, 2).reshape(batch, length),
      losses)
