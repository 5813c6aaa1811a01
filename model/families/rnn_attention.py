"""`rnn_attention`: the recurrent encoder-decoder with attention of Bahdanau
et al. (2015), the model attention was introduced in.

A bidirectional LSTM (or GRU) reads the source; each position's annotation
h_j is its forward and backward states concatenated, [B, S, 2D]. The
decoder is a recurrent cell of width D: at step i it scores every
annotation against its previous state s_{i-1} (additive, v . tanh(W s +
U h), or Luong et al.'s "general" s . W h), takes the softmax over the
source's real positions, forms the context c_i = sum_j a_ij h_j, and feeds
[embedding of y_{i-1}; c_i] to the cell: s_i. The logits read s_i and c_i
through a tanh layer and the (tied) output embedding. The initial state is
tanh(W h_1^backward). Dropout (config.dropout_rate) acts on the embeddings
and on that tanh layer.

Each target step waits for the one before (O(T) sequential steps, against
one for self-attention); the annotations and U h_j are computed once. For
decoding, the state carried between steps (the "cache") holds the cell
state and the source's annotations, so beam search can copy and reorder it
as it does a key/value cache.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention import core
from model.config import PAD_ID, ModelConfig
from model.families.family import Family
from model.readout import Readout
from model.weight_decay import undecayed

Array = jax.Array


def _cell(config: ModelConfig, name: str) -> nn.RNNCellBase:
  cell = {'lstm': nn.OptimizedLSTMCell, 'gru': nn.GRUCell}[config.rnn_cell]
  return cell(config.d_model, dtype=config.compute_dtype,
              param_dtype=config.weight_dtype,
              bias_init=undecayed(nn.initializers.zeros, (None,)), name=name)


def _hidden(cell_state):
  """The cell's output state h of its carry (LSTM: (c, h); GRU: h)."""
  return cell_state[1] if isinstance(cell_state, tuple) else cell_state


class AttentionScore(nn.Module):
  """Scores [B, S] of a decoder state [B, D] against the annotations' keys
  [B, S, D] (U h_j, or W h_j for 'general', projected once by the model)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, state_BxD: Array, keys_BxSxD: Array) -> Array:
    if self.config.rnn_score == 'general':
      return jnp.einsum('bd,bsd->bs', state_BxD, keys_BxSxD)
    query_BxD = nn.Dense(self.config.d_model, use_bias=False,
                         dtype=self.config.compute_dtype,
                         param_dtype=self.config.weight_dtype,
                         name='query')(state_BxD)
    v_D = self.param('v', nn.initializers.normal(stddev=self.config.d_model
                                                 ** -0.5),
                     (self.config.d_model,), self.config.weight_dtype)
    return jnp.einsum('bsd,d->bs', jnp.tanh(query_BxD[:, None] + keys_BxSxD),
                      v_D.astype(keys_BxSxD.dtype))


class DecoderStep(nn.Module):
  """One decoder step: (state, embedded previous token [B, D]) -> (state,
  ([s_i; c_i] [B, 3D], attention weights [B, S]))."""

  config: ModelConfig

  @nn.compact
  def __call__(self, state, embedded_BxD: Array):
    cell_state, annotations_BxSx2D, keys_BxSxD, mask_BxS = (
        state['cell'], state['annotations'], state['keys'], state['mask'])
    scores_BxS = AttentionScore(self.config, name='score')(
        _hidden(cell_state), keys_BxSxD).astype(jnp.float32)
    # An empty source (a batch's filler row) gets zero weights, not NaN.
    weights_BxS = core.softmax_or_zero(
        jnp.where(mask_BxS, scores_BxS, -jnp.inf))
    context_Bx2D = jnp.einsum('bs,bsd->bd',
                              weights_BxS.astype(annotations_BxSx2D.dtype),
                              annotations_BxSx2D)
    cell_state, output_BxD = _cell(self.config, 'cell')(
        cell_state, jnp.concatenate([embedded_BxD, context_Bx2D], axis=-1))
    return dict(state, cell=cell_state), (
        jnp.concatenate([output_BxD, context_Bx2D], axis=-1), weights_BxS)


class RnnAttention(nn.Module):
  """Source [B, S] and decoder inputs [B, T] (targets shifted right) to
  logits [B, T, V], float32."""

  config: ModelConfig

  def setup(self):
    config = self.config
    self.embedder = nn.Embed(
        config.vocab_size, config.d_model, dtype=config.compute_dtype,
        param_dtype=config.weight_dtype,
        embedding_init=nn.initializers.normal(stddev=config.d_model ** -0.5))
    self.encoder = nn.Bidirectional(
        nn.RNN(_cell(config, 'forward')), nn.RNN(_cell(config, 'backward')))
    dense = lambda name: nn.Dense(
        config.d_model, dtype=config.compute_dtype,
        param_dtype=config.weight_dtype,
        bias_init=undecayed(nn.initializers.zeros, (None,)), name=name)
    self.initial, self.readout = dense('initial'), dense('readout')
    self.attention_keys = nn.Dense(
        config.d_model, use_bias=False, dtype=config.compute_dtype,
        param_dtype=config.weight_dtype)
    self.steps = nn.scan(DecoderStep, variable_broadcast='params',
                         split_rngs={'params': False}, in_axes=1,
                         out_axes=1)(config)
    self.dropout = nn.Dropout(config.dropout_rate)

  def start(self, inputs_BxS: Array, *, deterministic: bool = True) -> dict:
    """The decoder's state before its first step: the encoder's
    annotations of the source, their projected keys, the source mask and
    the initial cell state."""
    mask_BxS = inputs_BxS != PAD_ID
    embedded_BxSxD = self.dropout(self.embedder(inputs_BxS),
                                  deterministic=deterministic)
    annotations_BxSx2D = self.encoder(embedded_BxSxD,
                                      seq_lengths=jnp.sum(mask_BxS, axis=1))
    # The backward RNN's state at the first position: it has read it all.
    first_backward_BxD = annotations_BxSx2D[:, 0, self.config.d_model:]
    hidden_BxD = jnp.tanh(self.initial(first_backward_BxD))
    cell_state = ((jnp.zeros_like(hidden_BxD), hidden_BxD)
                  if self.config.rnn_cell == 'lstm' else hidden_BxD)
    return {'cell': cell_state, 'annotations': annotations_BxSx2D,
            'keys': self.attention_keys(annotations_BxSx2D),
            'mask': mask_BxS}

  def decode(self, state: dict, decoder_inputs_BxT: Array, *,
             deterministic: bool = True, readout: bool = False
             ) -> tuple[Array | Readout, dict]:
    """(logits [B, T, V] (with `readout`, their `Readout`), the state after
    the T steps) for decoder inputs [B, T]; the attention weights [B, T, S]
    are sown as the intermediate 'attention_weights'."""
    embedded_BxTxD = self.dropout(self.embedder(decoder_inputs_BxT),
                                  deterministic=deterministic)
    state, (outputs_BxTx3D, weights_BxTxS) = self.steps(state,
                                                        embedded_BxTxD)
    self.sow('intermediates', 'attention_weights', weights_BxTxS)
    readout_BxTxD = self.dropout(jnp.tanh(self.readout(outputs_BxTx3D)),
                                 deterministic=deterministic)
    # The output projection is the embedding transposed.
    out = Readout(readout_BxTxD, self.embedder.embedding, weights_spec='vd',
                  compute_dtype=self.config.compute_dtype,
                  cap=self.config.logit_softcap)
    return (out if readout else out.logits()), state

  def __call__(self, inputs_BxS: Array, decoder_inputs_BxT: Array, *,
               deterministic: bool = True, readout: bool = False
               ) -> tuple[Array | Readout, None]:
    """(logits [B, T, V] or their `Readout`, no state)."""
    state = self.start(inputs_BxS, deterministic=deterministic)
    out, _ = self.decode(state, decoder_inputs_BxT,
                         deterministic=deterministic, readout=readout)
    return out, None

  def start_decoding(self, inputs_BxS: Array, length: int
                     ) -> tuple[None, dict]:
    """(nothing shared, the decoder's state): the state holds the sources'
    annotations, and knows its position (`length` is not needed)."""
    del length
    return None, self.start(inputs_BxS)

  def decoding_step(self, source: None, inputs_BxS: Array,
                    tokens_BxT: Array, positions_BxT: Array, state: dict
                    ) -> tuple[Array, dict]:
    """(logits [B, T, V], the state after `tokens_BxT`)."""
    del source, inputs_BxS, positions_BxT
    return self.decode(state, tokens_BxT)


FAMILY = Family(
    name='rnn_attention', module=RnnAttention, tasks=('seq2seq',),
    # One attention a target step, scored over D and reading values of 2D.
    attention_layers=lambda config: 3,
    sequential_steps=lambda config, length: 2 * length,
    inputs_method=None, feed_forward=False, multi_head=False)
