"""The model families: shapes, dtypes, parameter counts, and properties."""

import dataclasses
import math
import re

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model import DecoderLM, EncoderClassifier, EncoderDecoder, ModelConfig
from model import positions as positions_lib
from model.families import build
from model.layers import MultiHeadAttention
from tests.helpers.causality import assert_causal
from tests.helpers.compiled import compiled

B, T = 2, 8
V, D, HEADS, KV_HEADS, LAYERS, MLP, MAX_LEN = 32, 32, 4, 2, 2, 64, 16


def small_config(**overrides) -> ModelConfig:
  values = dict(vocab_size=V, d_model=D, num_heads=HEADS, num_kv_heads=KV_HEADS,
                num_layers=LAYERS, mlp_dim=MLP, max_len=MAX_LEN)
  values.update(overrides)
  return ModelConfig(**values)


def tokens(seed=0, length=T):
  """[B, T] ids in 1..V-1; example 1 ends in 3 padding tokens."""
  ids = np.random.default_rng(seed).integers(1, V, (B, length))
  ids[1, -3:] = 0
  return jnp.asarray(ids)


def model_inputs(config: ModelConfig):
  if config.family == 'encoder_decoder':
    return tokens(0), tokens(1)
  return (tokens(0),)


def init(config: ModelConfig):
  return jax.jit(build(config).init)(jax.random.key(0),
                                     *model_inputs(config))


def count(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(tree)))


def expected_parameter_count(config: ModelConfig) -> int:
  """Counted from the architecture: every projection has a bias."""
  d, m, heads, kv_heads, head_dim = (config.d_model, config.mlp_dim,
                                     config.num_heads, config.num_kv_heads,
                                     config.head_dim)
  norm = 2 * d if config.norm == 'layernorm' else d
  attention = ((d + 1) * heads * head_dim + 2 * (d + 1) * kv_heads * head_dim
               + heads * head_dim * d + d)
  mlp = (d + 1) * m * (2 if config.mlp_activation == 'swiglu' else 1) + m * d + d

  # Self-attention's sinks: a logit per query head.
  sinks = heads if config.attention_sinks else 0

  def stack(cross):
    block = (attention + sinks + mlp + 2 * norm
             + (attention + norm if cross else 0))
    return config.num_layers * block + (norm if config.norm_position == 'pre'
                                        else 0)

  embedder = config.vocab_size * d
  if config.position == 'learned':
    embedder += config.max_len * d
  if not config.tie_embeddings:
    embedder += d * config.vocab_size + config.vocab_size
  if config.family == 'decoder_lm':
    return embedder + stack(cross=False)
  if config.family == 'encoder_decoder':
    return embedder + stack(cross=False) + stack(cross=True)
  head = d * config.num_classes + config.num_classes
  return (embedder + stack(cross=False) + head
          + (d if config.pooling == 'cls' else 0))


FAMILY_CONFIGS = {
    'decoder_lm': small_config(),
    'decoder_lm_untied_learned_swiglu_rms': small_config(
        tie_embeddings=False, position='learned', mlp_activation='swiglu',
        norm='rmsnorm'),
    'encoder_decoder_post_norm_sinks': small_config(
        family='encoder_decoder', norm_position='post', attention_sinks=True),
    'classifier_cls': small_config(family='encoder_classifier', num_classes=5),
    'classifier_mean_mqa': small_config(family='encoder_classifier',
                                        num_classes=3, pooling='mean',
                                        num_kv_heads=1, head_dim=16),
}


@pytest.mark.core
@pytest.mark.parametrize('name', FAMILY_CONFIGS)
def test_parameter_count_matches_architecture(name):
  config = FAMILY_CONFIGS[name]
  shapes = jax.eval_shape(lambda: init(config))
  assert count(shapes['params']) == expected_parameter_count(config)


@pytest.mark.parametrize('name', FAMILY_CONFIGS)
def test_output_shape_and_dtype(name):
  config = FAMILY_CONFIGS[name]
  variables = init(config)
  out, _ = compiled(build(config).apply)(variables, *model_inputs(config))
  expected = {'decoder_lm': (B, T, V), 'encoder_decoder': (B, T, V),
              'encoder_classifier': (B, config.num_classes)}[config.family]
  assert out.shape == expected and out.dtype == jnp.float32
  assert np.isfinite(out).all()


@pytest.mark.parametrize('name', ['decoder_lm_untied_learned_swiglu_rms',
                                  'encoder_decoder_post_norm_sinks',
                                  'classifier_cls'])
def test_logit_softcap_caps_every_familys_logits(name):
  """cap * tanh(logits / cap) of the uncapped model's logits, with the same
  parameters (the cap has none)."""
  config = FAMILY_CONFIGS[name]
  variables = init(config)
  logits = lambda config: compiled(build(config).apply)(
      variables, *model_inputs(config))[0]
  uncapped = logits(config)
  capped = logits(dataclasses.replace(config, logit_softcap=0.05))
  assert np.abs(uncapped).max() > 0.05 >= np.abs(capped).max()
  np.testing.assert_allclose(capped, 0.05 * np.tanh(uncapped / 0.05),
                             rtol=1e-5, atol=1e-7)


def test_zero_init_outputs_starts_every_block_as_the_identity():
  """Attention's output projection, the MLP's and the experts' second
  layers start at zero, the rest as before; their gradients do not."""
  config = small_config(zero_init_outputs=True,
                        moe={'num_experts': 2, 'every_n_layers': 2})
  params = nn.meta.unbox(init(config))['params']
  zero = {path: bool(np.all(np.asarray(value) == 0)) for path, value in
          flax.traverse_util.flatten_dict(params, sep='/').items()}
  outputs = {path for path in zero
             if re.search(r'/(out/kernel|wo/kernel|wo)$', path)}
  assert len(outputs) == 2 * LAYERS  # An attention and a feed-forward each.
  assert all(zero[path] for path in outputs)
  assert not any(zero[path] for path in zero
                 if 'kernel' in path or 'embedding' in path
                 if path not in outputs)
  model = build(config)
  grads = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(
      {'params': p}, *model_inputs(config))[0] ** 2)))(params)
  flat = flax.traverse_util.flatten_dict(grads, sep='/')
  assert all(np.any(np.asarray(flat[path]) != 0) for path in outputs)


def test_every_parameter_has_logical_axis_names():
  for config in FAMILY_CONFIGS.values():
    boxed = jax.eval_shape(lambda config=config: init(config))['params']
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(
        x, nn.LogicallyPartitioned))
    for leaf in leaves:
      assert isinstance(leaf, nn.LogicallyPartitioned)
      assert len(leaf.names) == leaf.value.ndim


def test_grouped_query_projections_have_kv_heads():
  params = nn.meta.unbox(init(small_config())['params'])
  attention = params['decoder']['block_0']['self_attention']
  assert attention['query']['kernel'].shape == (D, HEADS, D // HEADS)
  assert attention['key']['kernel'].shape == (D, KV_HEADS, D // HEADS)
  assert attention['value']['kernel'].shape == (D, KV_HEADS, D // HEADS)


def test_bfloat16_compute_keeps_float32_params_and_logits():
  config = small_config(dtype='bfloat16')
  model = build(config)
  variables = init(config)
  (logits, _), state = compiled(model.apply)(variables, tokens(),
                                             capture_intermediates=True)
  params = nn.meta.unbox(variables['params'])
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  assert logits.dtype == jnp.float32
  block_out = state['intermediates']['decoder']['block_0']['__call__'][0][0]
  assert block_out.dtype == jnp.bfloat16
  reference, _ = compiled(build(small_config()).apply)(variables, tokens())
  np.testing.assert_allclose(logits, reference, atol=0.1)


@pytest.mark.core
def test_decoder_lm_is_causal():
  """d(logits at t)/d(embeddings at s) is exactly zero for every s > t."""
  assert_causal(DecoderLM(small_config()), tokens())


def test_encoder_decoder_prefix_logits_ignore_later_targets():
  config = small_config(family='encoder_decoder')
  model = EncoderDecoder(config)
  variables = init(config)
  targets = tokens(1)
  changed = targets.at[:, 5:].set(7)
  apply = compiled(model.apply)
  logits, _ = apply(variables, tokens(0), targets)
  changed_logits, _ = apply(variables, tokens(0), changed)
  np.testing.assert_array_equal(logits[:, :5], changed_logits[:, :5])
  assert not np.allclose(logits[:, 5:], changed_logits[:, 5:])


def test_encoder_decoder_ignores_padded_source_tokens():
  config = small_config(family='encoder_decoder')
  model = EncoderDecoder(config)
  variables = init(config)
  source = tokens(0)
  # Example 1's last 3 source tokens are padding; what the encoder writes
  # there must not reach the decoder.
  encoded = compiled(model.apply)(variables, source, method='encode')
  noise = jnp.zeros_like(encoded).at[1, -3:].set(100.0)
  decode = lambda e: compiled(model.apply)(variables, e, source, tokens(1),
                                           method='decode')[0]
  np.testing.assert_allclose(decode(encoded), decode(encoded + noise),
                             atol=1e-5)


@pytest.mark.parametrize('position, equivariant', [('none', True),
                                                   ('sinusoidal', False)])
def test_self_attention_is_permutation_equivariant_only_without_positions(
    position, equivariant):
  config = small_config(family='encoder_decoder', position=position)
  model = EncoderDecoder(config)
  variables = init(config)
  source = tokens(4).at[1].set(tokens(5)[0])  # no padding
  perm = np.random.default_rng(0).permutation(T)
  encode = lambda x: compiled(model.apply)(variables, x, method='encode')
  permuted_then_encoded = encode(source[:, perm])
  encoded_then_permuted = encode(source)[:, perm]
  assert np.allclose(permuted_then_encoded, encoded_then_permuted,
                     atol=1e-5) == equivariant


def test_encoder_ignores_padding_tokens():
  """Real positions encode as they would with no padding after them."""
  config = small_config(family='encoder_decoder')
  model = EncoderDecoder(config)
  variables = init(config)
  source = tokens(0)  # Example 1 ends in 3 padding tokens.
  encode = compiled(model.apply)
  encoded = encode(variables, source, method='encode')
  trimmed = encode(variables, source[1:, :T - 3], method='encode')
  np.testing.assert_allclose(encoded[1, :T - 3], trimmed[0], atol=1e-5)


@pytest.mark.parametrize('pooling', ['cls', 'mean'])
def test_classifier_ignores_padding(pooling):
  config = small_config(family='encoder_classifier', pooling=pooling,
                        position='learned', max_len=MAX_LEN + 1)
  model = EncoderClassifier(config)
  variables = init(config)
  source = tokens(0)
  longer = jnp.pad(source, ((0, 0), (0, 4)))
  classify = lambda x: compiled(model.apply)(variables, x)[0]
  logits = classify(source)
  np.testing.assert_allclose(logits, classify(longer), atol=1e-5)
  # The pooled vector depends on the tokens themselves.
  assert not np.allclose(logits, classify(source.at[:, 0].set(5)))


def test_sinusoidal_positions_follow_the_formula():
  positions = np.array([[0, 1, 5, 17]])
  d_model = 6
  expected = np.zeros((1, 4, d_model))
  for t, p in enumerate(positions[0]):
    for i in range(d_model // 2):
      angle = p / 10000 ** (2 * i / d_model)
      expected[0, t, 2 * i], expected[0, t, 2 * i + 1] = (np.sin(angle),
                                                          np.cos(angle))
  np.testing.assert_allclose(positions_lib.sinusoidal(positions, d_model),
                             expected, atol=1e-5)


def test_tied_logits_are_the_embedding_transposed_over_sqrt_d():
  config = small_config()
  variables = init(config)
  (logits, _), state = compiled(build(config).apply)(
      variables, tokens(), capture_intermediates=True)
  hidden = state['intermediates']['decoder']['final_norm']['__call__'][0]
  embedding = nn.meta.unbox(
      variables['params'])['embedder']['token_embedding']['embedding']
  np.testing.assert_allclose(logits, hidden @ embedding.T / np.sqrt(D),
                             atol=1e-5)


@pytest.mark.parametrize('norm_position', ['pre', 'post'])
def test_only_post_norm_blocks_end_in_a_norm(norm_position):
  config = small_config(norm_position=norm_position)
  _, state = compiled(build(config).apply)(init(config), tokens(),
                                           capture_intermediates=True)
  out_BxTxD = state['intermediates']['decoder']['block_0']['__call__'][0][0]
  # A fresh LayerNorm (scale 1, bias 0) leaves each position at mean 0 and
  # variance 1; a pre-norm block returns the residual sum, which is not.
  normalized = (np.allclose(out_BxTxD.mean(-1), 0.0, atol=1e-4)
                and np.allclose(out_BxTxD.var(-1), 1.0, atol=1e-2))
  assert normalized == (norm_position == 'post')


def test_learned_positions_reject_sequences_longer_than_max_len():
  config = small_config(position='learned', max_len=T)
  variables = init(config)
  with pytest.raises(ValueError, match='config.model.max_len=8'):
    build(config).apply(variables, tokens(length=T + 1))


def test_inputs_of_the_wrong_shape_are_refused_naming_them():
  """Checked as the model is traced (chex), before any block runs."""
  model, key = build(small_config()), jax.random.key(0)
  with pytest.raises(ValueError, match=r'tokens have shape \(2, 8, 1\); '
                     r'expected rank 2 \[batch, length\]'):
    model.init(key, tokens()[..., None])
  with pytest.raises(ValueError, match=r'positions have shape \(2, 7\); '
                     r"expected the tokens' \[batch, length\] = \(2, 8\)"):
    model.init(key, tokens(), jnp.zeros((B, T - 1), jnp.int32))


@pytest.mark.parametrize('policy', ['full', 'dots_saveable'])
def test_remat_gives_the_same_gradients(policy):
  def grads(config):
    model = build(config)
    variables = init(config)
    loss = lambda p: jnp.sum(model.apply({'params': p}, tokens())[0] ** 2)
    return jax.jit(jax.grad(loss))(variables['params'])

  plain, remat = grads(small_config()), grads(small_config(remat=policy))
  chex.assert_trees_all_close(nn.meta.unbox(plain), nn.meta.unbox(remat),
                              rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('rates', [dict(dropout_rate=0.3),
                                   dict(attention_dropout_rate=0.3)])
def test_dropout_is_active_only_when_not_deterministic(rates):
  config = small_config(**rates)
  model = build(config)
  variables = init(config)
  apply = lambda seed, deterministic: compiled(model.apply)(
      variables, tokens(), deterministic=deterministic,
      rngs={'dropout': jax.random.key(seed)})[0]
  np.testing.assert_array_equal(apply(0, True), apply(1, True))
  assert not np.allclose(apply(0, False), apply(1, False))
  np.testing.assert_array_equal(apply(0, False), apply(0, False))


@pytest.mark.parametrize('overrides', [
    dict(norm_position='pre', norm='layernorm', mlp_activation='gelu'),
    dict(norm_position='post', norm='rmsnorm', mlp_activation='relu'),
    dict(attention='dense,local', attention_options={'local': {'window': 2}}),
    dict(attention_projections=False),
], ids=['pre_layernorm_gelu', 'post_rmsnorm_relu', 'dense_local_layers',
        'parameter_free_attention'])
def test_decoder_lm_trains(overrides):
  config = small_config(**overrides)
  model = build(config)
  params = nn.meta.unbox(init(config)['params'])
  inputs = tokens()
  targets = jnp.roll(inputs, -1, axis=1)
  optimizer = optax.adam(1e-2)

  @jax.jit
  def step(params, opt_state):
    def loss_fn(params):
      logits, _ = model.apply({'params': params}, inputs)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, targets).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = optimizer.init(params)
  losses = []
  for _ in range(5):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_parameter_free_self_attention_is_the_notes_first_form():
  """y_i = sum_j softmax_j(x_i . x_j) x_j: no parameters, equal to the
  formula written out, and permutation-equivariant."""
  config = small_config(attention_projections=False)
  layer = MultiHeadAttention(config)
  x = jax.random.normal(jax.random.key(3), (B, T, D)) / 4
  variables = layer.init(jax.random.key(0), x, x)
  assert not jax.tree.leaves(variables)
  attend = lambda x: compiled(layer.apply)(variables, x, x)[0]
  weights = jax.nn.softmax(jnp.einsum('bid,bjd->bij', x, x), axis=-1)
  np.testing.assert_allclose(attend(x), jnp.einsum('bij,bjd->bid', weights,
                                                   x), atol=1e-5)
  permutation = np.random.default_rng(0).permutation(T)
  np.testing.assert_allclose(attend(x[:, permutation]),
                             attend(x)[:, permutation], atol=1e-5)
  # In a model, self-attention holds nothing; the MLPs and norms remain.
  blocks = nn.meta.unbox(init(config)['params'])['decoder']
  assert all('self_attention' not in blocks[f'block_{i}']
             for i in range(LAYERS))


def test_an_attention_pattern_gives_each_layer_its_entry():
  """'dense,additive' over 4 layers: additive's own parameters, of the
  width its options ask, are in layers 1 and 3 only."""
  config = small_config(num_layers=4, attention='dense,additive',
                        attention_options={'additive': {'hidden': 3}})
  assert [c.attention for c in map(config.for_layer, range(4))] == [
      'dense', 'additive', 'dense', 'additive']
  params = nn.meta.unbox(init(config)['params'])['decoder']
  attention_params = [params[f'block_{i}']['self_attention']
                      for i in range(4)]
  assert ['additive_query' in p for p in attention_params] == [
      False, True, False, True]
  assert attention_params[3]['additive_query'].shape == (HEADS, D // HEADS,
                                                         3)


def test_packed_rows_build_no_length_by_length_mask():
  """Segment ids reach the attention function, which compares them block
  by block: the compiled gradient holds no [.., T, T] mask."""
  length = 16
  config = small_config(attention='chunked',
                        attention_options={'chunk_size': 4})
  model = DecoderLM(config)
  packed = jnp.ones((B, length), jnp.int32)
  segment_ids = jnp.asarray(np.repeat([[1, 2], [1, 1]], length // 2, axis=1))
  positions = jnp.asarray(np.tile(np.arange(length) % (length // 2), (B, 1)))
  # Compiled, never run: the parameters' shapes suffice.
  params = jax.eval_shape(model.init, jax.random.key(0), packed)['params']
  loss = lambda p: jnp.sum(model.apply({'params': p}, packed, positions,
                                       segment_ids)[0])
  hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
  assert 'pred[2,1,1,4,4]' in hlo  # A block's [B, K, G, Q, C] of ids.
  assert not re.findall(rf'pred\[[0-9,]*{length},{length}\]', hlo)


def test_packed_rows_equal_separate_sequences():
  """Two sequences packed in one row give the logits each gives alone."""
  config = small_config(position='learned')
  model = DecoderLM(config)
  variables = {'params': init(config)['params']}
  first, second = tokens(0)[0, :5], tokens(1)[0, :3]
  packed = jnp.concatenate([first, second])[None]
  segment_ids = jnp.array([[1] * 5 + [2] * 3])
  positions = jnp.array([list(range(5)) + list(range(3))])
  apply = compiled(model.apply)
  logits, _ = apply(variables, packed, positions, segment_ids)
  np.testing.assert_allclose(logits[0, :5],
                             apply(variables, first[None])[0][0], atol=1e-5)
  np.testing.assert_allclose(logits[0, 5:],
                             apply(variables, second[None])[0][0], atol=1e-5)
