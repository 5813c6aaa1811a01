"""Cached decoding: a prompt read in one call, then one token a call, gives
the logits of a full forward pass at every position; the ways of choosing
tokens do what they say."""

import dataclasses
import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import ModelConfig, build, layer_stack
from model.state import Cache
from tests.helpers.tiny_runs import tiny_config
from train import generate
from train.base.errors import InputError
from train.decode import decoding
from train.run.trainer import train_and_evaluate

B, T, V = 2, 10, 16
# Real prompt tokens per example; the prompts are right-padded to the
# longest, and each example's own positions continue after its prompt.
PROMPT_LENGTHS = np.array([3, 6])


def tiny(family: str, position: str, **overrides) -> ModelConfig:
  return ModelConfig(**dict(
      family=family, vocab_size=V, d_model=16, num_heads=4, num_kv_heads=2,
      num_layers=2, mlp_dim=32, max_len=T, position=position,
      relative_max_distance=4, relative_buckets=8) | overrides)


def cached_logits(step, positions_to_read: int) -> np.ndarray:
  """[B, T, V] logits from `step(tokens_BxT, positions_BxT, cache,
  valid_BxT)`: the padded prompts in one call (valid_BxT False at their
  padding), then each example's next tokens one a call. Positions never
  read stay zero."""
  tokens = np.asarray(jax.random.randint(jax.random.key(0), (B, T), 1, V))
  prompt_len = PROMPT_LENGTHS.max()
  prompts = np.where(np.arange(prompt_len) < PROMPT_LENGTHS[:, None],
                     tokens[:, :prompt_len], 0)
  logits, cache = step(prompts, np.tile(np.arange(prompt_len), (B, 1)),
                       None, np.arange(prompt_len) < PROMPT_LENGTHS[:, None])
  got = np.zeros((B, T, V), np.float32)
  for b in range(B):
    got[b, :PROMPT_LENGTHS[b]] = logits[b, :PROMPT_LENGTHS[b]]
  for t in range(positions_to_read - PROMPT_LENGTHS.min()):
    positions = np.minimum(PROMPT_LENGTHS + t, T - 1)
    logits, cache = step(tokens[np.arange(B), positions][:, None],
                         positions[:, None], cache)
    for b in range(B):
      if PROMPT_LENGTHS[b] + t < T:
        got[b, positions[b]] = logits[b, 0]
  return tokens, got


@pytest.mark.parametrize('position,overrides', [
    # Rope and ALiBi alone: in the cases below.
    (position, {}) for position in ('learned', 'sinusoidal', 'relative',
                                    't5_bias', 'deberta')] + [
    # Parameter-free self-attention caches the inputs themselves.
    ('rope', dict(attention_projections=False)),
    # Under QK-norm the cache holds keys normalised, then rotated.
    ('rope', dict(qk_norm='rmsnorm')),
    # Each layer caches its values mixed with the first layer's; after the
    # first, the layers run as a loop whose caches are stacked.
    ('rope', dict(value_residual=True, scan_layers=True, num_layers=3)),
    # Smear reads the embedding the cache holds at the position before;
    # the value embeddings of each call's tokens join its values.
    ('alibi', dict(smear=True, value_embeddings=1, unet_skips=True)),
    # Local attention decodes as dense under its window, here one short
    # and one long (shorter than the rows), with its sinks.
    ('alibi', dict(attention='local,local', attention_sinks=True,
                   attention_options={'local': {'window': (4, 2)}})),
    # Each recurrence carries its state [B, N, H, H] (four query heads on
    # two key/value heads), the padding of the shorter prompt left out of
    # it; chunks of 4 positions, so the prompts' call runs the chunked
    # form across chunks and the tokens after it the recurrent one. Two
    # of them convolve q/k/v too, so their states hold the last inputs.
    ('rope', dict(attention='retnet,mamba2,gla,deltanet,gated_deltanet',
                  num_layers=5, attention_options={
                      name: {'chunk_size': 4} | (
                          {'conv_width': 4} if name in ('mamba2', 'deltanet')
                          else {})
                      for name in ('retnet', 'mamba2', 'gla', 'deltanet',
                                   'gated_deltanet')})),
    # Under scan_layers, the states of the repeated blocks stacked, beside
    # a latent attention's latents and rope parts (half of each head, of
    # four on two key/value heads); the recent inputs of the convolution
    # stacked with them.
    ('rope', dict(attention='gated_deltanet,mla', num_layers=4,
                  scan_layers=True, rope_fraction=0.5,
                  attention_options={'gated_deltanet': {'conv_width': 3},
                                     'mla': {'kv_rank': 6, 'q_rank': 5}}))])
def test_decoder_lm_cached_logits_equal_a_full_pass(position, overrides):
  config = tiny('decoder_lm', position, **overrides)
  model = build(config)
  params = {'params': jax.jit(model.init)(jax.random.key(1),
                                          jnp.zeros((1, T), jnp.int32))[
                                              'params']}
  if config.smear:  # Its gate starts closed.
    params['params']['smear'] = {'gate': jnp.full((12,), 0.3),
                                 'gain': jnp.ones((1,))}

  @jax.jit
  def step(tokens, positions, cache, valid=None):
    return model.apply(params, tokens, positions, cache=cache,
                       valid_BxT=valid)

  def step_or_start(tokens, positions, cache, valid=None):
    cache = Cache.empty(config, B, T) if cache is None else cache
    return step(tokens, positions, cache, valid)

  tokens, got = cached_logits(step_or_start, T)
  want, _ = jax.jit(model.apply)(params, tokens)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('position,overrides', [
    ('sinusoidal', {}), ('relative', {}),
    ('sinusoidal', dict(value_residual=True, scan_layers=True,
                        num_layers=3))])
def test_encoder_decoder_cached_logits_equal_a_full_pass(position, overrides):
  """The sources' cross-attention keys and values are projected once; rows
  decoded in two copies each (beam search's layout) read them alike."""
  config = tiny('encoder_decoder', position, **overrides)
  model = build(config)
  source = jnp.asarray(np.array([[3, 4, 5, 1, 0, 0], [6, 7, 8, 9, 2, 1]]))
  params = jax.jit(model.init)(jax.random.key(1), source,
                               jnp.zeros((B, T), jnp.int32))['params']
  step, empty = decoding.seq2seq_step(model, params, source, T)
  step = jax.jit(step)

  def step_or_start(tokens, positions, cache, valid=None):
    return step(tokens, positions, empty if cache is None else cache, valid)

  tokens, got = cached_logits(step_or_start, T)
  want, _ = jax.jit(model.apply)({'params': params}, source, tokens)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  twice, _ = step(np.repeat(tokens, 2, axis=0),
                  np.tile(np.arange(T), (2 * B, 1)),
                  Cache.empty(config, 2 * B, T))
  np.testing.assert_allclose(twice, np.repeat(want, 2, axis=0), atol=1e-5,
                             rtol=1e-5)


def test_generate_refuses_a_run_that_cannot_read_a_cache_before_loading_it(
    data_dir, tmp_path):
  """The workdir holds only the run's config: no checkpoint is read."""
  config = tiny_config('lm_stdlib', data_dir)
  config.model.attention = 'strided'
  config.sample_length = 0
  (tmp_path / 'config.json').write_text(config.to_json_best_effort())
  with pytest.raises(InputError, match=(
      'train.generate decodes with a cache, and in the run in '
      f"{tmp_path} config.model.attention='strided' cannot decode with a "
      'cache')):
    generate.generate(str(tmp_path), 'def ', max_new_tokens=4,
                      temperature=0.0)


def test_generate_refuses_a_run_of_another_task(data_dir, tmp_path):
  config = tiny_config('listops', data_dir)
  (tmp_path / 'config.json').write_text(config.to_json_best_effort())
  with pytest.raises(InputError, match=(
      f'train.generate does not decode {tmp_path}: it holds a run of family '
      "'encoder_classifier' on 'listops' \\(classification\\).")):
    generate.generate(str(tmp_path), '', max_new_tokens=4, temperature=0.0)


def test_a_variant_that_cannot_read_a_cache_is_refused():
  config = tiny('decoder_lm', 'rope', attention='strided',
                attention_options={'stride': 4})
  model = build(config)
  params = {'params': jax.jit(model.init)(jax.random.key(1),
                                          jnp.zeros((1, T), jnp.int32))[
                                              'params']}
  with pytest.raises(ValueError, match="attention='strided' cannot read a "
                     'cache'):
    model.apply(params, jnp.ones((B, 1), jnp.int32), jnp.zeros((B, 1),
                                                               jnp.int32),
                cache=Cache.empty(config, B, T))


# --- choosing tokens ---


def nucleus(probs: np.ndarray, p: float) -> np.ndarray:
  """The smallest set of most probable tokens holding `p`, by a sorted
  cumulative sum."""
  order = np.argsort(-probs)
  size = int(np.argmax(np.cumsum(probs[order]) >= p)) + 1
  kept = np.zeros(probs.shape, bool)
  kept[order[:size]] = True
  return kept


def test_top_p_keeps_exactly_the_smallest_set_that_reaches_p():
  logits = jax.random.normal(jax.random.key(2), (64, V)) * 2
  probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
  for p in (0.05, 0.3, 0.61, 0.9, 0.999):
    got = np.asarray(decoding.top_p_mask(logits, p))
    for row, mask in zip(probs, got):
      np.testing.assert_array_equal(mask, nucleus(row, p))


def test_top_p_near_0_and_1_on_a_large_vocabulary():
  """p = 1 keeps the float32 tail of a 50,000-token vocabulary (its least
  probable tokens), which a cumulative sum from the top rounds away; a
  tiny p keeps the most probable token."""
  logits = jax.random.normal(jax.random.key(4), (2, 50_000)) * 3
  assert np.asarray(decoding.top_p_mask(logits, 1.0)).all()
  logits64 = np.asarray(logits, np.float64)  # The reference in float64.
  probs = np.exp(logits64 - logits64.max(axis=-1, keepdims=True))
  probs /= probs.sum(axis=-1, keepdims=True)
  for p in (1 - 1e-4, 1 - 1e-6):
    got = np.asarray(decoding.top_p_mask(logits, p))
    for row, mask in zip(probs, got):
      np.testing.assert_array_equal(mask, nucleus(row, p))
    assert not got.all()
  # Below float32's resolution of 1 - p: the most probable token alone.
  top = np.asarray(decoding.top_p_mask(logits, 1e-9))
  np.testing.assert_array_equal(top, np.asarray(
      jax.nn.one_hot(jnp.argmax(logits, axis=-1), 50_000, dtype=bool)))


@pytest.mark.core
def test_top_k_keeps_the_k_largest():
  logits = jax.random.normal(jax.random.key(3), (8, V))
  assert np.asarray(decoding.top_k_mask(logits, V + 5)).all()
  mask = np.asarray(decoding.top_k_mask(logits, 3))
  assert (mask.sum(axis=-1) == 3).all()
  smallest_kept = np.where(mask, logits, np.inf).min(axis=-1)
  largest_dropped = np.where(mask, -np.inf, logits).max(axis=-1)
  assert (smallest_kept > largest_dropped).all()


@pytest.mark.parametrize('temperature', [0.5, 2.0])
def test_sampling_applies_the_temperature_then_top_k_then_top_p(temperature):
  logits = np.asarray(jax.random.normal(jax.random.key(7), (32, V)) * 2,
                      np.float64)
  for top_k, top_p in ((0, 0.3), (0, 0.8), (5, 0.6)):
    got = np.asarray(decoding.sampling_logits(
        jnp.asarray(logits, jnp.float32), temperature=temperature,
        top_k=top_k, top_p=top_p))
    for row, kept in zip(logits / temperature, np.isfinite(got)):
      if top_k:
        row = np.where(row >= np.sort(row)[-top_k], row, -np.inf)
      probs = np.exp(row - row.max())
      np.testing.assert_array_equal(kept, nucleus(probs / probs.sum(), top_p))
    np.testing.assert_allclose(got[np.isfinite(got)],
                               (logits / temperature)[np.isfinite(got)],
                               rtol=1e-6)


@pytest.fixture(scope='module')
def lm():
  config = tiny('decoder_lm', 'rope', max_len=16)
  model = build(config)
  params = jax.jit(model.init)(jax.random.key(4),
                               jnp.zeros((1, T), jnp.int32))
  prompts = np.array([[1, 5, 7, 0], [1, 2, 3, 4]], np.int32)
  return model, params['params'], prompts, np.array([3, 4])


def greedy_by_full_passes(model, params, prompts, lengths, num_tokens):
  """Greedy decoding that recomputes a full forward pass per token."""
  rows = [list(prompt[:length]) for prompt, length in zip(prompts, lengths)]
  forward = jax.jit(lambda tokens: model.apply({'params': params},
                                               tokens)[0])
  for _ in range(num_tokens):
    buffer = np.zeros((len(rows), 16), np.int32)
    for b, row in enumerate(rows):
      buffer[b, :len(row)] = row
    logits = np.asarray(forward(buffer))
    for b, row in enumerate(rows):
      row.append(int(np.argmax(logits[b, len(row) - 1])))
  return np.array([row[length:] for row, length in zip(rows, lengths)])


@pytest.mark.parametrize('choice', [
    dict(temperature=0.0), dict(temperature=1e-6),
    dict(temperature=1.0, top_k=1)], ids=['greedy', 'cold', 'top_k_1'])
def test_greedy_cold_and_top_1_sampling_equal_greedy_decoding(lm, choice):
  model, params, prompts, lengths = lm
  got = jax.jit(functools.partial(
      decoding.sample_lm, model, num_tokens=6, **choice))(
          params, prompts, lengths, rng=jax.random.key(5))
  np.testing.assert_array_equal(
      got, greedy_by_full_passes(model, params, prompts, lengths, 6))


def test_rows_end_at_eos(lm):
  model, params, prompts, lengths = lm
  greedy = greedy_by_full_passes(model, params, prompts, lengths, 6)
  eos = int(greedy[0, 1])  # Row 0 says it by its second token.
  got = np.asarray(decoding.sample_lm(
      model, params, prompts, lengths, num_tokens=6, rng=jax.random.key(5),
      temperature=0.0, eos_id=eos))
  for row, want in zip(got, greedy):
    stop = list(want).index(eos) + 1 if eos in want else 6
    np.testing.assert_array_equal(row, list(want[:stop]) + [0] * (6 - stop))
  assert (got == 0).any()


# --- beam search ---


def beam_lm(model, params, prompts, lengths, **options):
  cache = Cache.empty(model.config, prompts.shape[0],
                      prompts.shape[1] + options['num_tokens'])
  return jax.jit(functools.partial(
      decoding.beam_search, decoding.lm_step(model, params), **options))(
          cache, prompts, lengths)


def test_a_scanned_stack_beam_searches_as_its_blocks_one_by_one_do(lm):
  """Beam search copies and reorders the rows of a stacked cache (rows on
  its second axis) as of a cache per layer."""
  model, params, prompts, lengths = lm
  scanned = build(dataclasses.replace(model.config, scan_layers=True))
  stacked = layer_stack.relayout(nn.meta.unbox(params), nn.meta.unbox(
      jax.eval_shape(scanned.init, jax.random.key(4),
                     jnp.zeros((1, T), jnp.int32))['params']))
  options = dict(beam_size=3, num_tokens=5, eos_id=3, alpha=0.6)
  want = beam_lm(model, params, prompts, lengths, **options)
  got = beam_lm(scanned, stacked, prompts, lengths, **options)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5)


def test_beam_of_one_is_greedy(lm):
  model, params, prompts, lengths = lm
  greedy = greedy_by_full_passes(model, params, prompts, lengths, 6)
  eos = int(greedy[0, 2])
  tokens, _ = beam_lm(model, params, prompts, lengths, beam_size=1,
                      num_tokens=6, eos_id=eos, alpha=0.6)
  for row, want in zip(np.asarray(tokens)[:, 0], greedy):
    stop = list(want).index(eos) + 1 if eos in want else 6
    np.testing.assert_array_equal(row, list(want[:stop]) + [0] * (6 - stop))


def table_step(logits_BxLxVxV):
  """A step whose next-token logits are a table's, looked up by row (the
  "cache", which beam search copies and reorders with its beams), position
  and last token."""
  def step(tokens_BxT, positions_BxT, rows_B, valid_BxT=None):
    del valid_BxT
    return logits_BxLxVxV[rows_B[:, None], positions_BxT, tokens_BxT], rows_B
  return step


def greedy_by_table(logits_LxVxV, prompt, eos, num_tokens, alpha):
  """(tokens, score) of greedy decoding, written out."""
  tokens, logp, last = [], 0.0, prompt[-1]
  for position in range(len(prompt) - 1, len(prompt) - 1 + num_tokens):
    row = logits_LxVxV[position, last]
    log_probs = row - np.log(np.sum(np.exp(row - row.max()))) - row.max()
    last = int(np.argmax(row))
    tokens.append(last)
    logp += log_probs[last]
    if last == eos:
      break
  return (tokens + [0] * (num_tokens - len(tokens)),
          logp / ((5 + len(tokens)) / 6) ** alpha)


@pytest.mark.core
@pytest.mark.parametrize('alpha', [0.0, 0.6, 1.0])
def test_beam_of_one_is_greedy_for_any_length_penalty(alpha):
  """Row 0 is a near tie: after the prompt EOS (0.40) is just above 2
  (0.35), after which 2s and then EOS are all but certain, so a hypothesis
  kept alive beside the finished [EOS] would end with a better normalised
  score at alpha > 0. The other rows are random tables."""
  rows, steps, vocab, eos = 12, 5, 5, 1
  rng = np.random.default_rng(8)
  logits = rng.normal(size=(rows, steps + 2, vocab, vocab)) * 1.5
  tie = np.log(np.full((steps + 2, vocab, vocab), 0.0025))
  tie[1, 3, [1, 2, 3]] = np.log([0.40, 0.35, 0.245])
  tie[2:5, 2, 2] = tie[5, 2, 1] = np.log(0.99)
  logits[0] = tie
  lengths = rng.integers(1, 3, size=rows)
  lengths[0] = 2
  prompts = np.where(np.arange(2) < lengths[:, None],
                     rng.integers(2, vocab, size=(rows, 2)), 0)
  prompts[0] = [4, 3]
  tokens, scores = decoding.beam_search(
      table_step(jnp.asarray(logits, jnp.float32)), jnp.arange(rows),
      jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths), beam_size=1,
      num_tokens=steps, eos_id=eos, alpha=alpha)
  for row in range(rows):
    prompt = list(prompts[row, :lengths[row]])
    want, score = greedy_by_table(logits[row], prompt, eos, steps, alpha)
    np.testing.assert_array_equal(np.asarray(tokens)[row, 0], want)
    np.testing.assert_allclose(scores[row, 0], score, rtol=1e-5)
  assert list(np.asarray(tokens)[0, 0]) == [eos, 0, 0, 0, 0]


@pytest.mark.core
def test_a_wide_beam_finds_the_best_sequence_of_brute_force():
  config = tiny('decoder_lm', 'sinusoidal', vocab_size=4, max_len=8)
  model = build(config)
  params = jax.jit(model.init)(jax.random.key(6),
                               jnp.zeros((1, 8), jnp.int32))['params']
  prompt, eos, steps, alpha = np.array([[2, 3]], np.int32), 1, 3, 0.6
  tokens, scores = beam_lm(model, params, prompt, np.array([2]),
                           beam_size=64, num_tokens=steps, eos_id=eos,
                           alpha=alpha)

  log_probs = jax.jit(lambda row: jax.nn.log_softmax(
      model.apply({'params': params}, row[None])[0][0]))

  def score(continuation):
    row = np.zeros(8, np.int32)
    row[:2 + len(continuation)] = np.concatenate([prompt[0], continuation])
    logp = np.asarray(log_probs(row))
    total = sum(float(logp[1 + i, token])
                for i, token in enumerate(continuation))
    return total / float(decoding.length_penalty(len(continuation), alpha))

  # Every continuation that ends with EOS within `steps` tokens.
  ended = [list(body) + [eos] for length in range(steps)
           for body in itertools.product([0, 2, 3], repeat=length)]
  best = max(ended, key=score)
  np.testing.assert_array_equal(np.asarray(tokens)[0, 0],
                                best + [0] * (steps - len(best)))
  np.testing.assert_allclose(scores[0, 0], score(best), rtol=1e-5)


# --- the command line ---


@pytest.fixture(scope='module')
def lm_workdir(data_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('lm'))
  train_and_evaluate(tiny_config('lm_stdlib', data_dir), workdir)
  return workdir


def test_generate_continues_the_prompt(lm_workdir):
  texts = generate.generate(lm_workdir, 'def ', max_new_tokens=8,
                            temperature=0.0, num_samples=2)
  assert len(texts) == 2 and texts[0] == texts[1]  # Greedy.
  # A token is a byte: at most one character each (invalid bytes decode
  # as one replacement character).
  assert texts[0].startswith('def ') and len(texts[0]) <= 4 + 8
  drawn = generate.generate(lm_workdir, 'def ', max_new_tokens=8,
                            temperature=1.0, top_p=0.9, num_samples=3,
                            seed=1)
  assert all(text.startswith('def ') for text in drawn)


def test_generate_names_a_bad_flag(lm_workdir):
  with pytest.raises(InputError, match=r'--top_p=1.5 must be in \(0, 1\]'):
    generate.generate(lm_workdir, 'x', max_new_tokens=4, temperature=1.0,
                      top_p=1.5)
