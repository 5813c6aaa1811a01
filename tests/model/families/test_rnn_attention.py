"""The RNN encoder-decoder with attention (Bahdanau et al. 2015): its
attention is a distribution over the real source positions, its decoding
steps equal a full pass, and it learns a small task exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import rnn_attention
from model import ModelConfig, build
from model.families.rnn_attention import AttentionScore
from tests.helpers.adam_steps import adam_steps
from train.base.train_config import TrainConfig
from train.data import tasks
from train.decode import decoding
from train.program import mesh, steps
from train.run.program import compile_program

V, D = 13, 32
# Source rows of 5 and 3 symbols, padded to 6.
SOURCE = jnp.asarray([[3, 4, 5, 6, 7, 0], [8, 9, 10, 0, 0, 0]])
DECODER_INPUTS = jnp.asarray([[0, 7, 6, 5, 4, 3], [0, 10, 9, 8, 1, 0]])


def config_for(cell='lstm', score='additive') -> ModelConfig:
  return ModelConfig(family='rnn_attention', vocab_size=V, d_model=D,
                     rnn_cell=cell, rnn_score=score)


@pytest.mark.parametrize('cell, score', [('lstm', 'additive'),
                                         ('gru', 'general')])
def test_attention_is_a_distribution_over_the_real_source_positions(
    cell, score):
  model = build(config_for(cell, score))
  variables = jax.jit(model.init)(jax.random.key(0), SOURCE, DECODER_INPUTS)
  apply = jax.jit(model.apply, static_argnames=('method', 'mutable'))
  state = apply(variables, SOURCE, method='start')
  _, sown = apply(variables, state, DECODER_INPUTS, method='decode',
                  mutable=('intermediates',))
  [weights] = sown['intermediates']['attention_weights']  # [B, T, S]
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(weights[0, :, 5], 0.0)
  np.testing.assert_array_equal(weights[1, :, 3:], 0.0)
  # A row with no source at all (a batch's filler) attends to nothing.
  empty = SOURCE.at[1].set(0)
  assert np.isfinite(apply(variables, empty, DECODER_INPUTS)[0]).all()
  # More padding changes nothing: the encoder stops at each row's length.
  longer = jnp.pad(SOURCE, ((0, 0), (0, 3)))
  np.testing.assert_allclose(apply(variables, longer, DECODER_INPUTS)[0],
                             apply(variables, SOURCE, DECODER_INPUTS)[0],
                             atol=1e-5)


@pytest.mark.core
def test_additive_score_is_v_tanh_of_the_projected_state_and_keys():
  config = config_for()
  score = AttentionScore(config)
  state = jax.random.normal(jax.random.key(1), (2, D))
  keys = jax.random.normal(jax.random.key(2), (2, 6, D))
  params = score.init(jax.random.key(3), state, keys)['params']
  w, v = np.asarray(params['query']['kernel']), np.asarray(params['v'])
  expected = np.tanh((np.asarray(state) @ w)[:, None] + np.asarray(keys)) @ v
  np.testing.assert_allclose(score.apply({'params': params}, state, keys),
                             expected, atol=1e-5)


def test_decoding_a_token_a_step_equals_the_full_pass():
  config = config_for('gru', 'general')
  model = build(config)
  params = jax.jit(model.init)(jax.random.key(0), SOURCE,
                               DECODER_INPUTS)['params']
  step, state = decoding.seq2seq_step(model, params, SOURCE, 6)
  got = []
  for t in range(DECODER_INPUTS.shape[1]):
    logits, state = step(DECODER_INPUTS[:, t:t + 1], None, state)
    got.append(logits[:, 0])
  np.testing.assert_allclose(
      np.stack(got, axis=1),
      jax.jit(model.apply)({'params': params}, SOURCE, DECODER_INPUTS)[0],
      atol=1e-5)


def test_the_model_learns_to_reverse_a_handful_of_examples_exactly():
  rng = np.random.default_rng(0)
  sources = rng.integers(3, V, (8, 5))
  targets = np.concatenate([sources[:, ::-1], np.ones((8, 1), int)], axis=1)
  batch = {'inputs': jnp.asarray(np.pad(sources, ((0, 0), (0, 1)))),
           'decoder_inputs': jnp.asarray(np.pad(targets[:, :-1],
                                                ((0, 0), (1, 0)))),
           'targets': jnp.asarray(targets), 'weights': jnp.ones((8, 6))}
  model = build(config_for())
  params = steps.init_params(model, tasks.SEQ2SEQ, jax.random.key(0), 6)
  state, _ = adam_steps(model, tasks.SEQ2SEQ, params, batch, 150)
  logits, _ = jax.jit(model.apply)({'params': state.params}, batch['inputs'],
                                   batch['decoder_inputs'])
  np.testing.assert_array_equal(jnp.argmax(logits, -1), targets)
  # And greedy decoding, feeding its own outputs, finds them.
  step, cache = decoding.seq2seq_step(model, state.params, batch['inputs'], 7)
  tokens, _ = decoding.beam_search(
      step, cache, np.zeros((8, 1), np.int32), np.ones(8, np.int32),
      beam_size=1, num_tokens=6, eos_id=1)
  np.testing.assert_array_equal(tokens[:, 0], targets)


def test_it_trains_data_parallel_over_the_devices_as_on_one():
  """Its parameters carry no logical axis names: replicated, while the
  batch splits over the 8 devices; the steps equal one device's."""
  config = rnn_attention.get_config('task=reverse')
  config.batch_size, config.seq_len, config.warmup_steps = 8, 6, 1
  config.model.update(d_model=D)
  config = TrainConfig.from_config(config)
  rng = np.random.default_rng(0)
  sources = rng.integers(3, V, (8, 6))
  batch = {'inputs': sources, 'targets': sources[:, ::-1].copy(),
           'decoder_inputs': np.pad(sources[:, ::-1], ((0, 0), (1, 0)))[:, :6],
           'weights': np.ones((8, 6), np.float32)}

  def losses(devices):
    program = compile_program(
        config, tasks.SEQ2SEQ, mesh.make_mesh(config.parallelism, devices))
    state, out = program.init(), []
    with program.scope():
      for _ in range(3):
        state, sums = program.train_step(state, program.batch(batch),
                                         program.key(1))
        out.append(float(sums['loss_sum'] / sums['weight_sum']))
    return out

  np.testing.assert_allclose(losses(jax.devices()), losses(jax.devices()[:1]),
                             rtol=1e-5)
