"""Decoding with a cache (keys and values, or a recurrent state): the
prompts in one call, then one token a call, inside `lax.while_loop` (no
Python loop per token).

A model is seen through `step(tokens_BxT, positions_BxT, cache,
valid_BxT=None) -> (logits_BxTxV, cache)`: a DecoderLM, or a
sequence-to-sequence family's decoding step with its sources bound (see
`lm_step`, `seq2seq_step`; an RnnAttention's "cache" is its recurrent
state). Prompts are right-padded to a common length and each example
continues after its own (`prompt_lengths_B`), so examples of different
lengths share a batch: the prompts' call says which of its tokens are
padding (`valid_BxT`), which a recurrent attention's state must not read
(keys and values written there are overwritten before anything reads
them).
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import attention, state
from model.config import PAD_ID, ModelConfig

Array = jax.Array
# What a step carries from call to call, rows first: a model.state.Cache,
# or an RNN decoder's state (RnnAttention.start).
Cache = Any
Step = Callable[..., tuple[Array, Cache]]


def cache_refusal(model_config: ModelConfig) -> str | None:
  """Why this module cannot decode the model (None: it can): a
  self-attention that reads neither a key/value cache nor a recurrent
  state."""
  for layer_config in model_config.layer_configs():
    if not attention.spec(layer_config.attention).reads_cache:
      *others, last = [name for name in attention.names()
                       if attention.spec(name).reads_cache]
      readers = f'{", ".join(others)} and {last}' if others else last
      return (f'config.model.attention={layer_config.attention!r} cannot '
              f'decode with a cache ({readers} can)')
  return None


def _only_known(logits_BxTxV: Array, vocab_size: int | None) -> Array:
  """Logits with the ids from `vocab_size` on (which a model whose
  vocabulary is larger than its data's never saw as targets) impossible."""
  if vocab_size is None:
    return logits_BxTxV
  known_V = jnp.arange(logits_BxTxV.shape[-1]) < vocab_size
  return jnp.where(known_V, logits_BxTxV, -jnp.inf)


def lm_step(model: nn.Module, params, vocab_size: int | None = None) -> Step:
  """The step of a DecoderLM, choosing among ids below `vocab_size`."""
  def step(tokens_BxT, positions_BxT, cache, valid_BxT=None):
    logits_BxTxV, cache = model.apply({'params': params}, tokens_BxT,
                                      positions_BxT, cache=cache,
                                      valid_BxT=valid_BxT)
    return _only_known(logits_BxTxV, vocab_size), cache
  return step


def seq2seq_step(model: nn.Module, params, inputs_BxS: Array, length: int,
                 vocab_size: int | None = None) -> tuple[Step, Cache]:
  """The step of a sequence-to-sequence model's decoder, choosing among ids
  below `vocab_size`, and its empty cache for `length` positions.

  The model's `start_decoding` reads the sources once (an EncoderDecoder
  projects every layer's cross-attention keys and values of them); every
  step reads that, and k consecutive copies of each row (as beam search
  lays out its beams) read it without copying it. The cache is what the
  family carries: an EncoderDecoder's self-attention keys and values, an
  RnnAttention's state (which holds the sources' annotations)."""
  variables = {'params': params}
  source, cache = model.apply(variables, inputs_BxS, length,
                              method='start_decoding')

  def step(tokens_BxT, positions_BxT, cache, valid_BxT=None):
    del valid_BxT  # Its decoder's prompts are one token each.
    logits_BxTxV, cache = model.apply(
        variables, source, inputs_BxS, tokens_BxT, positions_BxT, cache,
        method='decoding_step')
    return _only_known(logits_BxTxV, vocab_size), cache
  return step, cache


def top_k_mask(logits_BxV: Array, k: int) -> Array:
  """True at each row's k largest logits (exactly k, ties broken by
  index; every logit when k >= V)."""
  _, indices_Bxk = jax.lax.top_k(logits_BxV, min(k, logits_BxV.shape[-1]))
  rows_Bxk = jnp.arange(logits_BxV.shape[0])[:, None]
  return jnp.zeros(logits_BxV.shape, bool).at[rows_Bxk, indices_Bxk].set(True)


def top_p_mask(logits_BxV: Array, p: float) -> Array:
  """True at each row's nucleus (Holtzman et al. 2020): the smallest set of
  most probable tokens whose probability mass reaches `p`."""
  order_BxV = jnp.argsort(-logits_BxV, axis=-1)
  probs_BxV = jnp.take_along_axis(jax.nn.softmax(logits_BxV, axis=-1),
                                  order_BxV, axis=-1)
  # A token is needed while the more probable ones hold less than p, or
  # equally while it and the less probable ones hold more than 1 - p. Each
  # is read from the sum that is exact where it counts: from the top for a
  # small p (a sum from the bottom rounds 1 - p to 1 and keeps nothing);
  # from the bottom for a large one, as Hugging Face's TopPLogitsWarper
  # does (a sum from the top rounds to 1 before the tail, and p = 1 would
  # drop it).
  before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
  tail_BxV = jax.lax.cumsum(probs_BxV, axis=1, reverse=True)
  keep_BxV = jnp.where(p < 0.5, before_BxV < p, tail_BxV > 1 - p)
  rows_Bx1 = jnp.arange(logits_BxV.shape[0])[:, None]
  return jnp.zeros(logits_BxV.shape, bool).at[rows_Bx1, order_BxV].set(
      keep_BxV)


def sampling_logits(logits_BxV: Array, *, temperature: float,
                    top_k: int = 0, top_p: float = 1.0) -> Array:
  """The logits a token is drawn from at `temperature` > 0, in this order:
  divided by the temperature, then restricted to the top_k tokens (0: all),
  then to the top_p nucleus of the distribution left (1: all); -inf
  outside (the convention of Hugging Face's generation and vLLM)."""
  logits_BxV = logits_BxV / temperature
  if top_k:
    logits_BxV = jnp.where(top_k_mask(logits_BxV, top_k), logits_BxV,
                           -jnp.inf)
  if top_p < 1.0:
    logits_BxV = jnp.where(top_p_mask(logits_BxV, top_p), logits_BxV,
                           -jnp.inf)
  return logits_BxV


def choose(logits_BxV: Array, rng: Array, *, temperature: float,
           top_k: int = 0, top_p: float = 1.0) -> Array:
  """The next token of each row [B]: greedy at temperature 0, else drawn
  from `sampling_logits`."""
  if temperature == 0.0:
    return jnp.argmax(logits_BxV, axis=-1)
  return jax.random.categorical(
      rng, sampling_logits(logits_BxV, temperature=temperature, top_k=top_k,
                           top_p=top_p), axis=-1)


def sample(step: Step, cache: Cache, prompts_BxP: Array,
           prompt_lengths_B: Array, *, num_tokens: int, rng: Array,
           temperature: float, top_k: int = 0, top_p: float = 1.0,
           eos_id: int | None = None) -> Array:
  """[B, num_tokens] tokens after each prompt (see `choose`); after an
  `eos_id` a row holds PAD_ID. The cache must hold P + num_tokens
  positions."""
  return _decode(step, cache, prompts_BxP, prompt_lengths_B,
                 num_tokens=num_tokens, rng=rng, temperature=temperature,
                 top_k=top_k, top_p=top_p, eos_id=eos_id)[0]


def _read_prompts(step: Step, cache: Cache, prompts_BxP: Array,
                  prompt_lengths_B: Array) -> tuple[Array, Cache]:
  """(the logits after each row's last prompt token [B, V], the cache
  after the prompts), in one call."""
  batch, prompt_len = prompts_BxP.shape
  positions_BxP = jnp.broadcast_to(jnp.arange(prompt_len), prompts_BxP.shape)
  logits_BxPxV, cache = step(prompts_BxP, positions_BxP, cache,
                             positions_BxP < prompt_lengths_B[:, None])
  # Each example's next token follows its own last prompt token.
  return logits_BxPxV[jnp.arange(batch), prompt_lengths_B - 1], cache


def _decode(step: Step, cache: Cache, prompts_BxP: Array,
            prompt_lengths_B: Array, *, num_tokens: int, rng: Array,
            eos_id: int | None, **choice) -> tuple[Array, Array, Array]:
  """`sample`'s tokens [B, num_tokens], the log-probability the model gives
  each row's tokens up to and including EOS [B], and their number [B]."""
  batch = prompts_BxP.shape[0]
  logits_BxV, cache = _read_prompts(step, cache, prompts_BxP,
                                    prompt_lengths_B)

  def not_done(carry):
    t, _, _, _, finished_B, _, _ = carry
    return (t < num_tokens) & ~jnp.all(finished_B)

  def next_token(carry):
    t, logits_BxV, cache, out_BxN, finished_B, (logp_B, length_B), rng = carry
    rng, draw = jax.random.split(rng)
    token_B = choose(logits_BxV, draw, **choice)
    token_B = jnp.where(finished_B, PAD_ID, token_B).astype(jnp.int32)
    out_BxN = out_BxN.at[:, t].set(token_B)
    token_logp_B = jnp.take_along_axis(
        jax.nn.log_softmax(logits_BxV, axis=-1), token_B[:, None], axis=-1)
    logp_B = logp_B + jnp.where(finished_B, 0.0, token_logp_B[:, 0])
    length_B = length_B + ~finished_B
    if eos_id is not None:
      finished_B = finished_B | (token_B == eos_id)
    logits_Bx1xV, cache = step(token_B[:, None],
                               (prompt_lengths_B + t)[:, None], cache)
    return (t + 1, logits_Bx1xV[:, 0], cache, out_BxN, finished_B,
            (logp_B, length_B), rng)

  carry = (jnp.int32(0), logits_BxV, cache,
           jnp.full((batch, num_tokens), PAD_ID, jnp.int32),
           jnp.zeros((batch,), bool),
           (jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.int32)),
           rng)
  _, _, _, tokens_BxN, _, (logp_B, length_B), _ = jax.lax.while_loop(
      not_done, next_token, carry)
  return tokens_BxN, logp_B, length_B


def length_penalty(length: Array, alpha: float) -> Array:
  """GNMT's length normalisation ((5 + length) / 6)^alpha (Wu et al. 2016):
  a hypothesis is ranked by its log-probability divided by this."""
  return ((5.0 + length) / 6.0) ** alpha


def _gather_beams(tree, index_BxK: Array):
  """Rows of [B, K, ...] arrays picked by beam index per row."""
  return jax.tree.map(
      lambda x: jnp.take_along_axis(
          x, index_BxK.reshape(index_BxK.shape + (1,) * (x.ndim - 2)),
          axis=1), tree)


def _best(scores_BxM: Array, tree, k: int):
  """The k best of M hypotheses per row by score: (scores, tree)."""
  scores_Bxk, index_Bxk = jax.lax.top_k(scores_BxM, k)
  return scores_Bxk, _gather_beams(tree, index_Bxk)


def beam_search(step: Step, cache: Cache, prompts_BxP: Array,
                prompt_lengths_B: Array, *, beam_size: int, num_tokens: int,
                eos_id: int, alpha: float = 0.6) -> tuple[Array, Array]:
  """The `beam_size` best continuations of each prompt, [B, K, num_tokens]
  (best first; PAD_ID after EOS), and their scores [B, K]: log-probability
  over `length_penalty` of the tokens up to and including EOS.

  A beam of one is greedy decoding, for any alpha. A wider one (as in
  tensor2tensor and Flax's WMT example): K hypotheses stay alive (the most
  probable that have not ended); those that end with `eos_id` among the K
  most probable extensions compete for K finished places by score. The
  search stops when no alive hypothesis can overtake the worst finished
  one, or after num_tokens; a row with no finished hypothesis returns its
  alive ones, scored at length num_tokens. `cache` is for B rows of
  P + num_tokens positions.
  """
  if beam_size == 1:
    # Not the search below with K = 1: beside a finished hypothesis it
    # keeps one alive, which can end later with a better normalised score.
    tokens_BxN, logp_B, length_B = _decode(
        step, cache, prompts_BxP, prompt_lengths_B, num_tokens=num_tokens,
        rng=jax.random.key(0), temperature=0.0, eos_id=eos_id)
    return (tokens_BxN[:, None],
            (logp_B / length_penalty(length_B, alpha))[:, None])
  batch = prompts_BxP.shape[0]
  k = beam_size
  logits_BxV, cache = _read_prompts(step, cache, prompts_BxP,
                                    prompt_lengths_B)
  vocab = logits_BxV.shape[-1]
  # Each row's cache, and its last logits, copied for its K beams.
  cache = state.map_rows(lambda x, axis: jnp.repeat(x, k, axis=axis),
                         cache)
  logits_BKxV = jnp.repeat(logits_BxV, k, axis=0)
  lengths_BK = jnp.repeat(prompt_lengths_B, k, axis=0)
  # One live beam at first, so that the first K tokens are distinct.
  alive_logp_BxK = jnp.tile(
      jnp.array([0.0] + [-jnp.inf] * (k - 1)), (batch, 1))
  empty_BxKxN = jnp.full((batch, k, num_tokens), PAD_ID, jnp.int32)
  finished_score_BxK = jnp.full((batch, k), -jnp.inf)
  final_penalty = length_penalty(num_tokens, alpha)

  def not_done(carry):
    t, _, alive_logp_BxK, _, finished_score_BxK, _, _ = carry
    # The best an alive hypothesis can still reach: its log-probability
    # only falls, and the penalty is largest at the longest length.
    best_alive_B = jnp.max(alive_logp_BxK, axis=1) / final_penalty
    can_improve_B = best_alive_B > jnp.min(finished_score_BxK, axis=1)
    return (t < num_tokens) & jnp.any(can_improve_B)

  def extend(carry):
    (t, logits_BKxV, alive_logp_BxK, alive_BxKxN, finished_score_BxK,
     finished_BxKxN, cache) = carry
    logp_BxKxV = jax.nn.log_softmax(logits_BKxV, axis=-1).reshape(
        batch, k, vocab)
    scores_BxKV = (alive_logp_BxK[..., None] + logp_BxKxV).reshape(
        batch, k * vocab)
    # 2K candidates: at most K end here, so K stay alive.
    logp_Bx2K, index_Bx2K = jax.lax.top_k(scores_BxKV, 2 * k)
    parent_Bx2K, token_Bx2K = index_Bx2K // vocab, index_Bx2K % vocab
    seqs_Bx2KxN = _gather_beams(alive_BxKxN, parent_Bx2K).at[:, :, t].set(
        token_Bx2K)
    # An EOS among the K best ends its hypothesis; one below them is
    # dropped.
    ends_Bx2K = token_Bx2K == eos_id
    finishes_Bx2K = ends_Bx2K & (jnp.arange(2 * k) < k)
    # Finished: the old and the new, ranked by normalised score.
    ended_Bx2K = jnp.where(finishes_Bx2K, logp_Bx2K,
                           -jnp.inf) / length_penalty(t + 1.0, alpha)
    finished_score_BxK, finished_BxKxN = _best(
        jnp.concatenate([finished_score_BxK, ended_Bx2K], axis=1),
        jnp.concatenate([finished_BxKxN, seqs_Bx2KxN], axis=1), k)
    # Alive: the K most probable that did not end.
    alive_logp_BxK, (alive_BxKxN, parent_BxK, token_BxK) = _best(
        jnp.where(ends_Bx2K, -jnp.inf, logp_Bx2K),
        (seqs_Bx2KxN, parent_Bx2K, token_Bx2K), k)
    rows_BK = (jnp.arange(batch)[:, None] * k + parent_BxK).reshape(-1)
    cache = state.map_rows(
        lambda x, axis: jnp.take(x, rows_BK, axis=axis), cache)
    logits_BKx1xV, cache = step(token_BxK.reshape(-1, 1),
                                (lengths_BK + t)[:, None], cache)
    return (t + 1, logits_BKx1xV[:, 0], alive_logp_BxK, alive_BxKxN,
            finished_score_BxK, finished_BxKxN, cache)

  carry = (jnp.int32(0), logits_BKxV, alive_logp_BxK, empty_BxKxN,
           finished_score_BxK, empty_BxKxN, cache)
  (_, _, alive_logp_BxK, alive_BxKxN, finished_score_BxK, finished_BxKxN,
   _) = jax.lax.while_loop(not_done, extend, carry)
  any_finished_B = jnp.isfinite(finished_score_BxK[:, 0])
  tokens_BxKxN = jnp.where(any_finished_B[:, None, None], finished_BxKxN,
                           alive_BxKxN)
  scores_BxK = jnp.where(any_finished_B[:, None], finished_score_BxK,
                         alive_logp_BxK / final_penalty)
  return tokens_BxKxN, scores_BxK


def sample_lm(model: nn.Module, params, prompts_BxP: Array,
              prompt_lengths_B: Array, *, num_tokens: int, rng: Array,
              vocab_size: int | None = None, **choice) -> Array:
  """`sample` from a DecoderLM with a fresh cache, among ids below
  `vocab_size`; `choice`: temperature, top_k, top_p, eos_id."""
  cache = state.Cache.empty(model.config, prompts_BxP.shape[0],
                            prompts_BxP.shape[1] + num_tokens)
  return sample(lm_step(model, params, vocab_size), cache, prompts_BxP,
                prompt_lengths_B, num_tokens=num_tokens, rng=rng, **choice)
