"""`encoder_classifier`: an encoder with a classification head over a
pooled representation."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.blocks import BlockInputs, TransformerStack
from model.config import PAD_ID, ModelConfig
from model.embedder import Embedder, default_positions
from model.families.family import Family
from model.attention.core import softcap
from model.weight_decay import undecayed

Array = jax.Array


class EncoderClassifier(nn.Module):
  """An encoder with a classification head over a pooled representation.

  `config.pooling == 'cls'` prepends a learned vector (position 0) and
  classifies its output (Devlin et al. 2019); 'mean' averages the outputs at
  non-padding positions.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens_BxT: Array, *, deterministic: bool = True
               ) -> tuple[Array, None]:
    """(class logits, float32 [B, num_classes], no state)."""
    config = self.config
    embedder = Embedder(config, name='embedder')
    x_BxTxD = embedder.embed_tokens(tokens_BxT)
    keys_valid_BxT = tokens_BxT != PAD_ID
    if config.pooling == 'cls':
      cls_D = self.param(
          'cls', nn.with_logical_partitioning(
              nn.initializers.normal(stddev=1.0), ('embed',)),
          (config.d_model,), config.weight_dtype)
      cls_Bx1xD = jnp.broadcast_to(cls_D.astype(x_BxTxD.dtype),
                                   (x_BxTxD.shape[0], 1, config.d_model))
      x_BxTxD = jnp.concatenate([cls_Bx1xD, x_BxTxD], axis=1)
      keys_valid_BxT = jnp.pad(keys_valid_BxT, ((0, 0), (1, 0)),
                               constant_values=True)
    positions_BxT = default_positions(keys_valid_BxT)
    x_BxTxD = embedder.add_positions(x_BxTxD, positions_BxT,
                                     deterministic=deterministic)
    x_BxTxD, _ = TransformerStack(config, causal=False, cross=False,
                                  name='encoder')(x_BxTxD, BlockInputs(
                                      positions_BxT,
                                      keys_valid_BxT[:, None, None, :],
                                      deterministic=deterministic))
    x_BxTxD = x_BxTxD.astype(jnp.float32)  # The head computes in float32.
    if config.pooling == 'cls':
      pooled_BxD = x_BxTxD[:, 0]
    else:
      weights_BxTx1 = keys_valid_BxT[..., None].astype(jnp.float32)
      pooled_BxD = (jnp.sum(x_BxTxD * weights_BxTx1, axis=1)
                    / jnp.maximum(jnp.sum(weights_BxTx1, axis=1), 1.0))
    classifier = nn.DenseGeneral(
        config.num_classes, dtype=jnp.float32,
        param_dtype=config.weight_dtype, name='classifier',
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.xavier_uniform(), ('embed', None)),
        bias_init=undecayed(nn.initializers.zeros, (None,)))
    return softcap(classifier(pooled_BxD), config.logit_softcap), None


FAMILY = Family(
    name='encoder_classifier', module=EncoderClassifier,
    tasks=('classification',),
    attention_layers=lambda config: config.num_layers,
    # The CLS vector before the tokens.
    extra_positions=lambda config: int(config.pooling == 'cls'),
    decoder=False)
