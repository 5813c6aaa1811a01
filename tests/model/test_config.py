"""ModelConfig validation: every mistake is named by its config key."""

import dataclasses
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from model import DecoderLM, ModelConfig, families
from model import config as config_module
from train import cli


def test_defaults_resolve_head_dim_and_kv_heads():
  config = ModelConfig(d_model=64, num_heads=4)
  assert config.head_dim == 16 and config.num_kv_heads == 4


def test_default_config_builds_a_model_config():
  config = default.get_config()
  assert ModelConfig.from_mapping(config.model) == ModelConfig()
  config.model.head_dim = 64
  assert ModelConfig.from_mapping(config.model).head_dim == 64


def test_attention_options_are_read_flat_or_under_the_attention_name():
  config = default.get_config()
  config.model.attention = 'local'
  config.model.attention_options.window = 8  # Set; the others unset.
  assert ModelConfig.from_mapping(config.model).attention_options == (
      ('window', 8),)
  config.model.attention_options.window = None
  config.model.attention_options.local.window = 8
  assert ModelConfig.from_mapping(config.model).attention_options == (
      ('window', 8),)
  config.model.attention = 'dense,local'
  assert ModelConfig.from_mapping(config.model).attention_options == (
      (), (('window', 8),))


def test_an_option_takes_one_value_per_occurrence_of_its_attention():
  config = default.get_config()
  config.model.attention = 'local,local'
  config.model.attention_options = {'local': {'window': (1024, 128)}}
  model_config = ModelConfig.from_mapping(config.model)
  assert model_config.attention_options == ((('window', 1024),),
                                            (('window', 128),))
  assert [dict(model_config.for_layer(layer).attention_options)['window']
          for layer in range(4)] == [1024, 128, 1024, 128]
  config.model.attention = 'local,local,local,dense'
  config.model.attention_options = {'local': {'window': [1024, 128, 64],
                                              'kernel': 'xla'}}
  assert ModelConfig.from_mapping(config.model).attention_options == (
      (('kernel', 'xla'), ('window', 1024)),
      (('kernel', 'xla'), ('window', 128)),
      (('kernel', 'xla'), ('window', 64)), ())


def test_the_command_line_gives_an_option_per_occurrence_as_one_string():
  """--config.model.attention_options.local.window=1024,128 and
  .kernel=xla,auto: the flag's value, split; a number's string read as the
  number."""
  config = cli.load_config('configs/lm_stdlib.py:baseline', {
      'model.attention': 'local,local',
      'model.attention_options.local.window': '1024,128',
      'model.attention_options.local.kernel': 'xla,auto'})
  assert ModelConfig.from_mapping(config.model).attention_options == (
      (('kernel', 'xla'), ('window', 1024)),
      (('kernel', 'auto'), ('window', 128)))
  assert ModelConfig(
      attention='local,local',
      attention_options={'local': {'window': '1024,128'}}
  ).attention_options == ((('window', 1024),), (('window', 128),))


def test_a_window_per_occurrence_reaches_each_layer():
  """Windows (8, 2) over four layers: the model of the same entries
  written out, not that of (8, 8)."""
  def logits(attention, attention_options):
    config = ModelConfig(vocab_size=32, d_model=16, num_heads=2, mlp_dim=32,
                         num_layers=4, max_len=16, attention=attention,
                         attention_options=attention_options)
    model = DecoderLM(config)
    return config, jax.jit(model.apply)(variables, tokens_1xT)[0]

  tokens_1xT = jnp.arange(1, 17)[None] % 32
  variables = jax.jit(DecoderLM(ModelConfig(
      vocab_size=32, d_model=16, num_heads=2, mlp_dim=32, num_layers=4,
      max_len=16)).init)(jax.random.key(0), tokens_1xT)
  config, alternating = logits('local,local', {'local': {'window': (8, 2)}})
  written, explicit = logits(('local', 'local'),
                             ((('window', 8),), (('window', 2),)))
  _, same = logits('local,local', {'local': {'window': (8, 8)}})
  assert config == written
  np.testing.assert_array_equal(alternating, explicit)
  assert not np.allclose(alternating, same)


@pytest.mark.parametrize('scan_layers', [False, True])
def test_value_residual_on_one_layer_is_the_model_without_it(scan_layers):
  """No later layer mixes the first one's values: the parameters of
  value_residual=False, one by one or as a scanned loop (shapes only)."""
  def parameters(value_residual):
    config = ModelConfig(vocab_size=32, d_model=16, num_heads=2, mlp_dim=32,
                         num_layers=1, max_len=16, scan_layers=scan_layers,
                         value_residual=value_residual)
    return jax.eval_shape(DecoderLM(config).init, jax.random.key(0),
                          jnp.ones((1, 16), jnp.int32))

  assert parameters(True) == parameters(False)


def test_every_model_field_has_a_comment():
  source = inspect.getsource(config_module)
  for field in dataclasses.fields(ModelConfig):
    line = source.index(f'\n  {field.name}: ')
    assert source[:line].rstrip().splitlines()[-1].strip().startswith('#'), (
        field.name)


@pytest.mark.core
@pytest.mark.parametrize('overrides, message', [
    (dict(d_model=100, num_heads=3),
     'config.model.num_heads=3 does not divide config.model.d_model=100'),
    (dict(num_heads=4, num_kv_heads=3),
     'config.model.num_kv_heads=3 does not divide config.model.num_heads=4'),
    (dict(num_layers=0), 'config.model.num_layers=0 must be a positive'),
    (dict(vocab_size=2.5), 'config.model.vocab_size=2.5'),
    (dict(mlp_activation='tanh'), "config.model.mlp_activation='tanh'"),
    (dict(norm='batchnorm'), "config.model.norm='batchnorm'"),
    (dict(norm_position='middle'), "config.model.norm_position='middle'"),
    (dict(position='rotary'), "config.model.position='rotary'"),
    (dict(family='rnn'), "config.model.family='rnn'"),
    (dict(attention='magic'), "config.model.attention='magic'"),
    (dict(attention_projections=False, position='alibi'),
     "config.model.position='alibi' biases each head, and config.model."
     'attention_projections=False'),
    (dict(attention_projections=1), 'config.model.attention_projections=1 '
     'must be True or False'),
    (dict(zero_init_outputs=0), 'config.model.zero_init_outputs=0 must be '
     'True or False'),
    (dict(logit_softcap=-1.0),
     'config.model.logit_softcap=-1.0 must be a finite number >= 0'),
    (dict(logit_softcap=float('inf')),
     'config.model.logit_softcap=inf must be a finite number >= 0'),
    (dict(zero_init_outputs=True, family='rnn_attention'),
     'config.model.zero_init_outputs is for the Transformer families'),
    (dict(value_residual=1), 'config.model.value_residual=1 must be True '
     'or False'),
    (dict(value_residual=True, family='rnn_attention'),
     'config.model.value_residual is for the Transformer families'),
    (dict(value_residual=True, attention_projections=False),
     'config.model.value_residual mixes projected values'),
    (dict(value_embeddings=3, num_layers=4),
     'config.model.value_embeddings=3 must be a whole number from 0 to '
     'config.model.num_layers / 2 = 2'),
    (dict(value_embeddings=1, scan_layers=True),
     'config.model.value_embeddings treats layers differently, which '
     'config.model.scan_layers'),
    (dict(unet_skips=True, scan_layers=True),
     'config.model.unet_skips treats layers differently'),
    (dict(smear=True, memory_length=8, position='relative'),
     'config.model.smear reads the tokens and hidden states of the positions '
     'it runs on, which a memory of earlier segments does not keep'),
    (dict(unet_skips=1), 'config.model.unet_skips=1 must be True or False'),
    (dict(unet_skips=True, num_layers=1),
     'config.model.unet_skips joins the first half of the blocks to the '
     'second; config.model.num_layers=1 has one'),
    (dict(smear=True, family='encoder_decoder'),
     "config.model.smear is for config.model.family='decoder_lm', one causal "
     "stack over its tokens; not 'encoder_decoder'"),
    (dict(value_embeddings=1, family='rnn_attention'),
     'config.model.value_embeddings is for config.model.family='),
    (dict(unet_skips=True, family='encoder_classifier'),
     'config.model.unet_skips is for config.model.family='),
    (dict(scan_layers=True, family='rnn_attention'),
     'config.model.scan_layers is for the Transformer families'),
    (dict(scan_layers=True, num_layers=3, attention='dense,local'),
     'config.model.scan_layers repeats a group of 2 blocks '
     '(config.model.attention cycles 2 entries), which does not divide the '
     '3 blocks of config.model.num_layers=3;'),
    (dict(scan_layers=True, num_layers=5, value_residual=True,
          moe={'num_experts': 2, 'every_n_layers': 3}),
     'a group of 3 blocks (config.model.moe.every_n_layers=3), which does '
     'not divide the 4 blocks of config.model.num_layers=5 after '
     "value_residual's first;"),
    (dict(moe={'num_experts': 4, 'top_k': 3}),
     'config.model.moe.top_k=3 must be 1 or 2, and at most'),
    (dict(moe={'experts': 4}), 'unknown key config.model.moe.experts'),
    (dict(num_layers=1, moe={'num_experts': 4}),
     'config.model.moe.every_n_layers=2 exceeds config.model.num_layers=1'),
    (dict(family='rnn_attention', moe={'num_experts': 4}),
     "config.model.moe.num_experts is for the Transformer families"),
    (dict(attention='dense,magic'),
     "config.model.attention[1]: config.model.attention='magic' must be"),
    (dict(attention='dense,local', attention_options={'window': 3}),
     "config.model.attention_options.window names no entry of "
     "config.model.attention='dense,local'; with several attentions, "
     'options are keyed by their names: config.model.attention_options.'
     '<name>.window.'),
    (dict(attention='local', attention_options={'window': 3,
                                                'local': {'window': 4}}),
     "config.model.attention_options sets ['window'] and local: "
     "['window']; give the options of one attention in one of the two "
     'places.'),
    (dict(attention='local,local',
          attention_options={'local': {'window': (1024, 128, 64)}}),
     'config.model.attention_options.local.window=(1024, 128, 64) gives 3 '
     "values; config.model.attention='local,local' names local 2 times: "
     'give one value, or one per occurrence.'),
    (dict(attention='dense,local',
          attention_options={'local': {'window': (1024, 128)}}),
     'config.model.attention_options.local.window=(1024, 128) gives 2 '
     "values; config.model.attention='dense,local' names local once: give "
     'one value.'),
    (dict(attention='local', attention_options={'window': '1024,128'}),
     "config.model.attention_options.window='1024,128' gives 2 values; "
     "config.model.attention='local' names local once: give one value."),
    (dict(attention='local,local',
          attention_options={'local': {'window': (1024, 12.8)}}),
     'config.model.attention_options.local.window=(1024, 12.8) must be of '
     'type int, one per occurrence of local.'),
    (dict(attention='local,local',
          attention_options={'local': {'window': '1024,wide'}}),
     "config.model.attention_options.local.window='1024,wide' must be of "
     'type int, one per occurrence of local.'),
    (dict(attention='dense,local',
          attention_options={'local': {'window': 'wide'}}),
     "config.model.attention_options.local.window='wide' must be of type "
     'int.'),
    (dict(dtype='float64'), "config.model.dtype='float64'"),
    (dict(dropout_rate=1.0), 'config.model.dropout_rate=1.0'),
    (dict(attention_dropout_rate=-0.1),
     'config.model.attention_dropout_rate=-0.1'),
    (dict(remat='yes'), "config.model.remat='yes'"),
    (dict(qk_norm='l2'), "config.model.qk_norm='l2' must be one of"),
    (dict(qk_norm='rmsnorm', attention_projections=False),
     "config.model.qk_norm='rmsnorm' scales queries and keys by parameters"),
    (dict(qk_norm='layernorm', family='rnn_attention'),
     "config.model.qk_norm is for config.model.family='decoder_lm'"),
    (dict(pooling='max'), "config.model.pooling='max'"),
])
def test_invalid_values_name_the_key(overrides, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    families.check(ModelConfig(**overrides))


def test_unknown_key_is_named():
  config = default.get_config()
  config.model.num_head = 8
  with pytest.raises(ValueError, match=r'unknown key config\.model\.num_head;'):
    ModelConfig.from_mapping(config.model)
