"""Training configs are checked before anything compiles, key by key."""

import re

import pytest

from configs import algorithmic, default, listops, lm1b, lm_stdlib
from configs import wmt14_ende
from train import config_validation
from train.errors import InputError


def test_every_shipped_config_is_valid():
  for config in (lm_stdlib.get_config(), algorithmic.get_config('task=sort'),
                 listops.get_config(), listops.get_config('full'),
                 lm1b.get_config(), wmt14_ende.get_config()):
    config.batch_size = 32  # A multiple of the 8 test devices.
    config_validation.validate(config)


def test_every_default_key_has_a_comment():
  source = open(default.__file__).read()
  for key in default.get_config().keys():
    line = source.index(f'config.{key} = ')
    previous = source[:line].rstrip().splitlines()[-1].strip()
    assert previous.startswith('#'), key


def test_config_arguments_are_checked():
  with pytest.raises(ValueError, match='task='):
    algorithmic.get_config('task=divide')
  with pytest.raises(ValueError, match="'full'"):
    listops.get_config('long')


def _set(config, key: str, value):
  *parents, leaf = key.split('.')
  for parent in parents:
    config = config[parent]
  config[leaf] = value


INVALID = [
    ('batch_size', 12, 'config.batch_size=12 must be divisible by the 8 '
     'batch slices'),
    ('batch_size', 0, 'config.batch_size=0 must be an integer >= 1'),
    ('seq_len', -5, 'config.seq_len=-5'),
    ('num_train_steps', -1, 'config.num_train_steps=-1'),
    ('seed', -1, 'config.seed=-1'),
    ('warmup_steps', 5000, 'config.warmup_steps=5000 exceeds'),
    ('log_every', 0, 'config.log_every=0'),
    ('eval_every', -1, 'config.eval_every=-1'),
    ('checkpoint_every', -2, 'config.checkpoint_every=-2'),
    ('keep_checkpoints', 0, 'config.keep_checkpoints=0'),
    ('num_eval_steps', 0, 'config.num_eval_steps=0'),
    ('grad_accum_steps', 3, 'config.grad_accum_steps=3 must split'),
    ('learning_rate', 0.0, 'config.learning_rate=0.0'),
    ('learning_rate', -1e-3, 'config.learning_rate=-0.001'),
    ('final_learning_rate_fraction', 1.5,
     'config.final_learning_rate_fraction=1.5'),
    ('weight_decay', -0.1, 'config.weight_decay=-0.1'),
    ('label_smoothing', 1.0, 'config.label_smoothing=1.0'),
    ('adam_b2', 1.0, 'config.adam_b2=1.0'),
    ('adam_eps', 0.0, 'config.adam_eps=0.0'),
    ('grad_clip_norm', -1.0, 'config.grad_clip_norm=-1.0'),
    ('schedule', 'step', "config.schedule='step' must be one of"),
    ('optimizer', 'lamb', "config.optimizer='lamb' must be one of"),
    ('dataset', 'imagenet', "config.dataset='imagenet' must be one of"),
    ('sample_length', -1, 'config.sample_length=-1'),
    ('sample_temperature', -0.5, 'config.sample_temperature=-0.5'),
    ('model.num_heads', 3, 'config.model.num_heads=3 does not divide'),
    ('model.num_kv_heads', 3, 'config.model.num_kv_heads=3 does not divide'),
    ('model.family', 'encoder_decoder',
     "config.model.family='encoder_decoder' cannot train on"),
    ('model.position', 'rotary', "config.model.position='rotary'"),
    ('model.dropout_rate', 1.0, 'config.model.dropout_rate=1.0'),
    ('model.dtype', 'int8', "config.model.dtype='int8'"),
    ('model.max_len', 100, 'config.seq_len=256 needs 256 positions, more '
     'than config.model.max_len=100'),
]


def test_packed_rows_need_an_attention_that_takes_any_mask():
  config = lm_stdlib.get_config()
  config.model.attention = 'linear'
  with pytest.raises(InputError, match='set config.pack_sequences=False'):
    config_validation.validate(config)
  config.pack_sequences = False
  config_validation.validate(config)


def test_a_memory_needs_streams():
  config = lm_stdlib.get_config()
  config.model.update(memory_length=64, position='rope')
  with pytest.raises(InputError, match='reads contiguous streams'):
    config_validation.validate(config)
  config.pack_sequences = False
  config_validation.validate(config)


@pytest.mark.parametrize('key, value, message', INVALID,
                         ids=[f'{key}={value}' for key, value, _ in INVALID])
def test_invalid_value_is_rejected_naming_its_key(key, value, message):
  config = lm_stdlib.get_config()
  if key == 'model.max_len':
    config.model.position = 'learned'
  _set(config, key, value)
  with pytest.raises(InputError, match=re.escape(message)):
    config_validation.validate(config)
