"""Every variant and position scheme inside the models, through config only."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model import ModelConfig, attention, build, families
from model.config import POSITIONS
from model.state import Memory
from tests.helpers.causality import assert_causal
from tests.helpers.distinct_variants import distinct_variants
from train.data import tasks
from train.program import steps

B, T, V = 2, 8, 32

# Options that make each variant non-trivial at length 8.
OPTIONS = {
    'dense': {},
    'chunked': {'chunk_size': 3},
    'local': {'window': 3},
    'strided': {'stride': 3},
    'fixed': {'block': 4, 'summary': 1},
    'bigbird': {'block': 2, 'num_global_blocks': 1, 'num_random_blocks': 1},
    'linformer': {'rank': 4},
    'performer': {'num_features': 16},
    'linear': {},
    'hedgehog': {'num_features': 8},
    'additive': {'hidden': 8},
    'memory_compressed': {'stride': 3, 'width': 3},
    'ring': {},
    'retnet': {'chunk_size': 3},
    'mamba2': {'chunk_size': 3},
    'gla': {'chunk_size': 3, 'gate_rank': 4},
    'deltanet': {'chunk_size': 3},
    'gated_deltanet': {'chunk_size': 3},
    'mla': {'kv_rank': 6, 'q_rank': 5, 'chunk_size': 3},
    'moba': {'block_size': 2, 'top_k': 1},
}
CAUSAL = [name for name in attention.names() if attention.spec(name).causal]


def config_for(family='decoder_lm', attention_name='dense', **overrides):
  """A one-layer model of `attention_name`; of several (a tuple), a layer
  each, each with its options."""
  several = isinstance(attention_name, tuple)
  values = dict(family=family, vocab_size=V, d_model=16, num_heads=2,
                num_layers=len(attention_name) if several else 1,
                mlp_dim=32, max_len=T + 1, attention=attention_name,
                attention_options={name: OPTIONS[name]
                                   for name in attention_name}
                if several else OPTIONS[attention_name], num_classes=3)
  values.update(overrides)
  config = ModelConfig(**values)
  families.check(config)
  return config


def test_every_registered_variant_has_test_options():
  assert sorted(OPTIONS) == attention.names()


def tokens(seed=0):
  ids = np.random.default_rng(seed).integers(1, V, (B, T))
  ids[1, -2:] = 0  # Padding, for the encoders' masks.
  return jnp.asarray(ids)


def batch_for(family):
  ids = tokens()
  if family == 'decoder_lm':
    return {'inputs': ids, 'targets': jnp.roll(ids, -1, axis=1),
            'positions': jnp.tile(jnp.arange(T), (B, 1)),
            'weights': (ids > 0).astype(jnp.float32)}
  if family == 'encoder_decoder':
    return {'inputs': ids, 'decoder_inputs': jnp.roll(ids, 1, axis=1),
            'targets': ids, 'weights': (ids > 0).astype(jnp.float32)}
  return {'inputs': ids, 'targets': jnp.array([0, 2]),
          'weights': jnp.ones((B,))}


TASK = {'decoder_lm': tasks.LM, 'encoder_decoder': tasks.SEQ2SEQ,
        'encoder_classifier': tasks.CLASSIFICATION}


def trains(config: ModelConfig) -> tuple[list[float], dict, dict]:
  """(losses of three Adam steps on one batch, the parameters before,
  after); a language model's logits are causal under the parameters
  after."""
  model = build(config)
  task = TASK[config.family]
  params = steps.init_params(model, task, jax.random.key(0), T)
  optimizer = optax.adam(3e-3)
  state = steps.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=optimizer.init(params))
  step = jax.jit(lambda state, batch: steps.train_step(
      state, batch, jax.random.key(0), model=model, task=task,
      optimizer=optimizer, learning_rates={}))
  batch = batch_for(config.family)
  losses = []
  for _ in range(3):
    state, metrics = step(state, batch)
    losses.append(float(metrics['loss_sum'] / metrics['weight_sum']))
  if config.family == 'decoder_lm':
    assert_causal(model, tokens(), positions=(0, 3, T - 1),
                  params=state.params)
  return losses, params, state.params


FAMILIES = ['decoder_lm', 'encoder_decoder', 'encoder_classifier']


def _compatible(family: str, name: str, position: str) -> bool:
  try:
    config_for(family, name, position=position)
  except ValueError:
    return False
  return True


def variant_runs() -> list[tuple[str, str, tuple[str, ...]]]:
  """(family, position, variants): a model for each position scheme a
  family takes, its layers the family's variants, each variant in one of
  them (one that takes its scheme, the fewest variants first; dense where
  there are fewer variants than schemes). One compiled step tests a scheme
  and the variants of its layers."""
  runs = []
  for family in FAMILIES:
    names = [name for name in attention.names()
             if family == 'encoder_classifier' or name in CAUSAL]
    if family == 'encoder_classifier':
      # A causal-only recurrence needs its stack; the encoder runs each
      # function once (mla's is chunked's: its projections run above).
      names = [name for name in names
               if not attention.spec(name).causal_only
               and name in distinct_variants()]
    elif family == 'encoder_decoder':
      # Its self-attention is the layer the decoder and the encoder above
      # run every variant through, causal and not: its schemes on dense.
      names = ['dense']
    # The family refuses a randomized scheme but where it has its own.
    layers = {position: [] for position in POSITIONS
              if _compatible(family, 'dense', position)}
    for name in names:
      takes = [position for position in layers
               if _compatible(family, name, position)]
      layers[min(takes, key=lambda position: len(layers[position]))].append(
          name)
    runs += [(family, position, tuple(names or ['dense']))
             for position, names in layers.items()]
  return runs


VARIANT_RUNS = variant_runs()


@pytest.mark.core
def test_every_position_scheme_meets_every_family_that_takes_it():
  takes = {(family, position) for family in FAMILIES for position in POSITIONS
           if _compatible(family, 'dense', position)}
  assert {(family, position) for family, position, _ in VARIANT_RUNS} == takes
  refused = {pair for pair in itertools.product(FAMILIES, POSITIONS)
             if pair not in takes}
  assert refused == {(family, 'random_sinusoidal') for family in FAMILIES
                     if family != 'encoder_decoder'}


@pytest.mark.core
def test_the_decoder_trains_each_causal_variant_and_the_encoder_each_other():
  ran = {family: [name for run_family, _, names in VARIANT_RUNS
                  if run_family == family for name in names]
         for family in FAMILIES}
  assert sorted(ran['decoder_lm']) == CAUSAL
  assert sorted(ran['encoder_classifier']) == [
      name for name in distinct_variants()
      if not attention.spec(name).causal_only]
  assert set(ran['encoder_decoder']) == {'dense'}


@pytest.mark.parametrize('family, position, names', VARIANT_RUNS)
def test_every_variant_and_position_scheme_trains_in_each_family(
    family, position, names):
  """Losses fall, and each layer's attention learns: its parameters but
  its output projection move (their gradients reach through the
  variant). The decoder's runs hold every causal variant and position
  scheme, each causal: no logit depends on a later token."""
  losses, before, after = trains(config_for(family, names,
                                            position=position))
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  moved = {}
  for (path, old), new in zip(
      jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after)):
    keys = [str(getattr(key, 'key', key)) for key in path]
    if 'self_attention' in keys and 'out' not in keys:
      block = tuple(keys[:keys.index('self_attention')])
      moved[block] = moved.get(block, False) or bool(np.any(old != new))
  assert len(moved) == len(names) * (2 if family == 'encoder_decoder'
                                     else 1)
  assert all(moved.values()), moved


@pytest.mark.core
def test_a_variant_is_refused_what_it_cannot_honour():
  with pytest.raises(ValueError, match="attention='linformer' cannot be"):
    config_for('decoder_lm', 'linformer')
  with pytest.raises(ValueError, match="position='alibi' adds a bias"):
    config_for('encoder_classifier', 'linear', position='alibi')
  with pytest.raises(ValueError, match="position='rope' makes scores"):
    config_for('decoder_lm', 'additive', position='rope')
  with pytest.raises(ValueError, match="attention='retnet' is causal only"):
    config_for('encoder_classifier', 'retnet')


TRANSFORMER_XL_CASES = (
    [('dense', position, length, {}) for position in
     ('rope', 'alibi', 't5_bias', 'relative') for length in (T, T + 3)]
    + [('chunked', 'rope', T, {}), ('chunked', 'alibi', T + 3, {}),
       ('additive', 'alibi', T, {}),
       # The first layer's values over the memory are its own memory's.
       ('dense', 'rope', T, dict(value_residual=True))])


@pytest.mark.parametrize('name, position, memory_length, overrides',
                         TRANSFORMER_XL_CASES)
def test_transformer_xl_memory_equals_one_long_causal_pass(
    name, position, memory_length, overrides):
  """Segment 2 read with the memory of segment 1 gives the logits of one
  pass over both, when the memory holds all of segment 1."""
  config = config_for(attention_name=name, position=position,
                      memory_length=memory_length, num_layers=2, **overrides)
  model = build(config)
  ids = jnp.asarray(np.random.default_rng(3).integers(1, V, (B, 2 * T)))
  params = {'params': jax.jit(model.init)(jax.random.key(0),
                                          ids[:, :T])['params']}
  apply = jax.jit(model.apply)
  long_pass, _ = apply(params, ids)
  first, memory = apply(params, ids[:, :T], memory=Memory.empty(config, B))
  second, _ = apply(params, ids[:, T:], memory=memory)
  np.testing.assert_allclose(first, long_pass[:, :T], atol=1e-5)
  np.testing.assert_allclose(second, long_pass[:, T:], atol=1e-5)


def test_transformer_xl_memory_forgets_beyond_its_length():
  config = config_for(position='rope', memory_length=3)
  model = build(config)
  ids = jnp.asarray(np.random.default_rng(4).integers(1, V, (B, 2 * T)))
  params = {'params': jax.jit(model.init)(jax.random.key(0),
                                          ids[:, :T])['params']}
  apply = jax.jit(model.apply)
  _, memory = apply(params, ids[:, :T], memory=Memory.empty(config, B))
  changed = ids.at[:, :T - 3].set(7)  # Before what the memory keeps.
  _, changed_memory = apply(params, changed[:, :T],
                            memory=Memory.empty(config, B))
  second, _ = apply(params, ids[:, T:], memory=memory)
  changed_second, _ = apply(params, ids[:, T:], memory=changed_memory)
  # Earlier layers' memories changed (they saw the tokens), so outputs may;
  # but with one layer the memory is the embeddings of the last 3 tokens.
  assert config.num_layers == 1
  np.testing.assert_allclose(second, changed_second, atol=1e-6)


@pytest.mark.parametrize('overrides, message', [
    (dict(memory_length=4), "needs a relative position scheme"),
    (dict(memory_length=4, position='rope', attention='linear',
          attention_options={}), 'more keys than queries'),
    (dict(memory_length=4, position='rope', family='encoder_classifier'),
     "for config.model.family='decoder_lm'"),
])
def test_memory_needs_what_it_reads(overrides, message):
  values = dict(family='decoder_lm', vocab_size=V, d_model=16, num_heads=2,
                num_layers=1, mlp_dim=32, max_len=T)
  values.update(overrides)
  with pytest.raises(ValueError, match=message):
    families.check(ModelConfig(**values))
