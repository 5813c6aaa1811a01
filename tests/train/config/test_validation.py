"""Training configs are checked before anything compiles, key by key: every
bad value exits with status 2 and one message naming its key."""

import dataclasses
import functools

import ml_collections
import pytest

from configs import algorithmic, default, listops, lm1b, lm_stdlib
from configs import lm_systems, published, rnn_attention, wmt14_ende
from model import attention, families
from model.attention import options as variant_options
from tests.helpers import config_overrides
from train import train
from train.base.errors import InputError
from train.base import train_config
from train.config import validation as config_validation
from train.data import tasks


def test_every_shipped_config_is_valid():
  for config in (*map(lm_stdlib.get_config, lm_stdlib.ARGS),
                 algorithmic.get_config('task=sort'),
                 listops.get_config(), listops.get_config('full'),
                 lm1b.get_config(), wmt14_ende.get_config(),
                 rnn_attention.get_config('task=reverse'),
                 *(lm_systems.get_config(f'system={system}')
                   for system in lm_systems.SYSTEMS)):
    config.batch_size = 32  # A multiple of the 8 test devices.
    config_validation.validate(config)


def warnings_of(config):
  return config_validation.warnings_of(
      train_config.TrainConfig.from_config(config))


def test_a_run_shorter_than_its_warmup_is_valid_and_warned_of():
  config = lm_stdlib.get_config('baseline')  # 50 warmup steps, cosine.
  assert warnings_of(config) == []
  config.num_train_steps = 20
  config_validation.validate(config)
  assert warnings_of(config) == [
      'config.warmup_steps=50 exceeds config.num_train_steps=20: the '
      'learning rate never leaves its warmup, reaching 0.4 of '
      'config.learning_rate=0.003.']


def test_a_wsd_run_too_short_for_its_warmup_and_cooldown_is_warned_of():
  config = lm_stdlib.get_config()  # 50 warmup steps, wsd over the last 0.2.
  assert warnings_of(config) == []
  config.num_train_steps = 20  # The smoke run.
  [warning] = warnings_of(config)
  assert warning == (
      'config.warmup_steps=50 and the wsd cooldown of 4 steps (config.'
      'decay_fraction=0.2 of config.num_train_steps=20) overlap: the '
      'learning rate rises on the warmup until it meets the cooldown, '
      'reaching at most 0.36 of config.learning_rate=0.0054, and ends at '
      '0.1 of it.')
  config.num_train_steps = 4  # The ramp is below the final rate at the end.
  assert warnings_of(config) == [
      'config.warmup_steps=50 exceeds config.num_train_steps=4: the '
      'learning rate never leaves its warmup, reaching 0.08 of '
      'config.learning_rate=0.0054.']


def test_a_key_the_optimizer_does_not_read_is_warned_of():
  config = lm_stdlib.get_config()  # Muon, at muon_learning_rate=0.0126.
  assert warnings_of(config) == []
  config.optimizer = 'adamw'
  assert warnings_of(config) == [
      "config.muon_learning_rate=0.0126 has no effect: config.optimizer="
      "'adamw' does not read it (muon and normuon do)."]
  config.muon_learning_rate = 0.02  # Its default: not set, not warned of.
  assert warnings_of(config) == []


def test_value_residual_on_one_layer_is_warned_of_not_refused():
  """make train's config shrunk to one layer: no later layer to mix the
  first one's values into; the config checks (its model traced)."""
  config = lm_stdlib.get_config()
  config.model.num_layers = 1
  checked = config_validation.validate(config)
  assert config_validation.warnings_of(checked) == [
      'config.model.value_residual=True has no effect: config.model.'
      'num_layers=1 has no layer after the first to mix the first layer\'s '
      'values into.']


def test_every_problem_of_a_config_is_reported_in_one_pass():
  """A sample that local attention cannot take and a misspelt kernel: both
  at once, the kernel with the nearest name."""
  config = BASELINE()  # sample_length=300.
  config.model.attention = 'strided'
  config.model.attention_options.kernel = 'palas_gpu'
  with pytest.raises(InputError) as error:
    config_validation.check(config)
  assert str(error.value).splitlines() == [
      "config.sample_length=300 samples with a cache, and "
      "config.model.attention='strided' cannot decode with a cache "
      '(additive, chunked, deltanet, dense, gated_deltanet, gla, local, '
      'mamba2, mla and retnet can); set it to 0.',
      "config.model.attention_options.kernel='palas_gpu' must be one of "
      "['auto', 'xla', 'cudnn', 'pallas_tpu', 'pallas_gpu']; did you mean "
      'pallas_gpu?']


def test_every_default_key_has_a_comment():
  """The training keys are declared in train/base/train_config.py, a
  comment above each; config.model's fields are checked in
  test_config.py."""
  source = open(train_config.__file__).read()
  declared = [field.name for field in dataclasses.fields(
      train_config.TrainConfig)]
  assert set(default.get_config().keys()) == set(declared)
  for key in declared:
    line = source.index(f'\n  {key}: ')
    previous = source[:line].rstrip().splitlines()[-1].strip()
    assert previous.startswith('#'), key


def test_every_family_trains_on_registered_tasks_and_every_task_has_one():
  for family in families.FAMILIES.values():
    assert set(family.tasks) <= set(tasks.TASKS), family.name
  for name in tasks.TASKS:
    assert families.trainers(name), name


def test_config_arguments_are_checked():
  with pytest.raises(ValueError, match='task='):
    algorithmic.get_config('task=divide')
  with pytest.raises(ValueError, match="'full'"):
    listops.get_config('long')


# (key, invalid value, what the message says), on lm_stdlib's config.
INVALID = [
    ('dataset', 'imagenet', "config.dataset='imagenet' must be one of"),
    ('dataset_options.task', 'sort', 'unknown key config.dataset_options.task '
     "for config.dataset='python_stdlib_bytes'; known keys: none"),
    ('data_dir', '', "config.data_dir='' must be a non-empty string"),
    ('data_dir', 'gs://bucket/data', "config.data_dir='gs://bucket/data': "
     'datasets are array_record files, whose reader opens local paths only'),
    ('seq_len', -5, 'config.seq_len=-5 must be an integer >= 1'),
    ('batch_size', 12, 'config.batch_size=12 must be divisible by the 8 '
     'batch slices'),
    ('batch_size', 0, 'config.batch_size=0 must be an integer >= 1'),
    ('eval_split', 'dev', "config.eval_split='dev' is not a split of config."
     "dataset='python_stdlib_bytes'; it has ['train', 'validation']"),
    ('num_eval_steps', 0, 'config.num_eval_steps=0'),
    ('num_train_steps', -1, 'config.num_train_steps=-1'),
    ('model.value_embeddings', 3, 'config.model.value_embeddings=3 must be '
     'a whole number from 0 to config.model.num_layers / 2 = 2'),
    ('window_schedule', ((10, 64),), 'config.window_schedule=((10, 64),) '
     'grows the windows of windowed attention (local); config.model.'
     'attention='),
    ('window_schedule', ((10, 0),), 'config.window_schedule=((10, 0),) must '
     'be (step, window) pairs of positive integers'),
    ('trained_params', 'mlp', "config.trained_params='mlp' must be one of"),
    ('tokenizer', '/nowhere/tokenizer.json',
     "config.tokenizer='/nowhere/tokenizer.json': there is no "
     'tokenizer.json there'),
    ('track_corpus', 'ABC', "config.track_corpus='ABC' must be a sha256 (64 "
     "lowercase hex digits) or ''"),
    ('optimizer', 'lamb', "config.optimizer='lamb' must be one of"),
    ('learning_rate', 0.0, 'config.learning_rate=0.0'),
    ('learning_rate', -1e-3, 'config.learning_rate=-0.001'),
    ('warmup_steps', -1, 'config.warmup_steps=-1 must be an integer >= 0'),
    ('schedule', 'step', "config.schedule='step' must be one of"),
    ('final_learning_rate_fraction', 1.5,
     'config.final_learning_rate_fraction=1.5'),
    ('decay_fraction', 0.0,
     'config.decay_fraction=0.0 must be a number in (0.0, 1.0]'),
    ('adam_b1', 1.5, 'config.adam_b1=1.5 must be a number in [0.0, 1.0)'),
    ('adam_b2', 1.0, 'config.adam_b2=1.0'),
    ('adam_eps', 0.0, 'config.adam_eps=0.0'),
    ('muon_learning_rate', 0.0, 'config.muon_learning_rate=0.0'),
    ('muon_momentum', 1.0, 'config.muon_momentum=1.0'),
    ('normuon_beta2', -0.5, 'config.normuon_beta2=-0.5'),
    ('sgd_momentum', -0.1, 'config.sgd_momentum=-0.1'),
    ('weight_decay', -0.1, 'config.weight_decay=-0.1'),
    ('grad_clip_norm', -1.0, 'config.grad_clip_norm=-1.0'),
    ('grad_accum_steps', 3, 'config.grad_accum_steps=3 must split'),
    ('steps_per_call', 0, 'config.steps_per_call=0 must be an integer >= 1'),
    # The baseline logs every 50 steps, evaluates and saves every 275.
    ('steps_per_call', 16, 'config.log_every=50 must be a multiple of '
     'config.steps_per_call=16: 48 or 64.\nerror: config.eval_every=275 '
     'must be a multiple of config.steps_per_call=16: 272 or 288.'),
    ('label_smoothing', 1.0, 'config.label_smoothing=1.0'),
    ('z_loss', -0.1, 'config.z_loss=-0.1 must be a number in [0.0, 1.0)'),
    ('seed', -1, 'config.seed=-1'),
    ('init_from', '/nonexistent', "config.init_from='/nonexistent' is not a "
     "training run's workdir (it has no config.json)"),
    ('log_every', 0, 'config.log_every=0'),
    ('eval_every', -1, 'config.eval_every=-1'),
    ('checkpoint_every', -2, 'config.checkpoint_every=-2'),
    ('keep_checkpoints', 0, 'config.keep_checkpoints=0'),
    ('nan_policy', 'ignore', "config.nan_policy='ignore' must be one of "
     "['stop', 'skip']"),
    ('max_skipped_steps', -1, 'config.max_skipped_steps=-1'),
    ('debug_poison_step', -3, 'config.debug_poison_step=-3'),
    ('sample_length', -1, 'config.sample_length=-1'),
    ('sample_prompt', 'x' * 300, 'config.sample_prompt is 300 tokens; it '
     'must be shorter than config.seq_len=256 - 1'),
    ('sample_temperature', -0.5, 'config.sample_temperature=-0.5'),
    ('decode_splits', ('validation',), "config.decode_splits=('validation',"
     "): decoding evaluates sequence-to-sequence datasets, and config.dataset="
     "'python_stdlib_bytes' is lm; set it to ()"),
    ('decode_splits', ('validation', 1), "config.decode_splits=('validation', "
     '1) must be a tuple of split names'),
    ('num_decode_examples', 0, 'config.num_decode_examples=0 must be an '
     'integer >= 1'),
    ('beam_size', 0, 'config.beam_size=0 must be an integer >= 1'),
    ('beam_alpha', -0.5, 'config.beam_alpha=-0.5 must be a number in'),
    ('parallelism.data', 3, 'config.parallelism: data=3 x fsdp=1 x tensor=1 '
     'x sequence=1 takes 3 devices, but there are 8'),
    ('parallelism.fsdp', 0, 'config.parallelism.fsdp=0 must be a positive '
     'integer, or -1'),
    ('parallelism.tensor', 3, 'the other axes take 3 devices, which does not '
     'divide the 8 devices'),
    ('parallelism.sequence', 16, 'the other axes take 16 devices'),
    ('parallelism.strategy', 'xmap', "config.parallelism.strategy='xmap' "
     'must be one of'),
    ('parallelism.dcn_data', 3, 'config.parallelism.dcn_data=3 must divide '
     'config.parallelism.data=8'),
    ('logical_axis_rules', (('embed', 'model'),), "config.logical_axis_rules: "
     "('embed', 'model') must map a name to mesh axes among"),
    ('model.family', 'encoder_decoder',
     "config.model.family='encoder_decoder' cannot train on"),
    ('model.vocab_size', 100, 'config.model.vocab_size=100 is smaller than '
     'the 258 token ids'),
    ('model.d_model', 0, 'config.model.d_model=0 must be a positive integer'),
    ('model.num_heads', 3, 'config.model.num_heads=3 does not divide'),
    ('model.num_kv_heads', 3, 'config.model.num_kv_heads=3 does not divide'),
    ('model.head_dim', 0, 'config.model.head_dim=0 must be a positive'),
    ('model.num_layers', 0, 'config.model.num_layers=0'),
    ('model.mlp_dim', -1, 'config.model.mlp_dim=-1'),
    ('model.mlp_activation', 'tanh', "config.model.mlp_activation='tanh'"),
    ('model.norm', 'batchnorm', "config.model.norm='batchnorm'"),
    ('model.qk_norm', 'l2', "config.model.qk_norm='l2' must be one of"),
    ('model.logit_softcap', -1.0,
     'config.model.logit_softcap=-1.0 must be a finite number >= 0'),
    ('model.norm_position', 'middle', "config.model.norm_position='middle'"),
    ('model.position', 'rotary', "config.model.position='rotary'"),
    ('model.max_len', 100, 'config.seq_len=256 needs 256 positions, more '
     'than config.model.max_len=100'),
    ('model.relative_max_distance', 0, 'config.model.relative_max_distance=0'),
    ('model.relative_buckets', 0, 'config.model.relative_buckets=0'),
    ('model.max_segments_per_row', 0,
     'config.model.max_segments_per_row=0 must be a positive integer'),
    ('model.rope_max_wavelength', 1.0, 'config.model.rope_max_wavelength=1.0 '
     'must be a number > 1'),
    ('model.rope_fraction', 0.5, 'config.model.rope_fraction=0.5 is the '
     "share of each head that rope rotates, and config.model.position="),
    ('model.norm_epsilon', 0.0, 'config.model.norm_epsilon=0.0 must be a '
     'finite number > 0'),
    ('model.embedding_init_stddev', -1.0, 'config.model.embedding_init_stddev'
     '=-1.0 must be a finite number > 0'),
    ('model.dropout_rate', 1.0, 'config.model.dropout_rate=1.0'),
    ('model.attention_dropout_rate', -0.1,
     'config.model.attention_dropout_rate=-0.1'),
    ('model.attention', 'flash', "config.model.attention='flash' must be one "
     'of'),
    ('model.attention_options.window', 16, 'unknown key config.model.'
     "attention_options.window for config.model.attention='dense'; it takes "
     "['logit_cap', 'scale']"),
    ('model.num_classes', 0, 'config.model.num_classes=0'),
    ('model.pooling', 'max', "config.model.pooling='max'"),
    ('model.dtype', 'int8', "config.model.dtype='int8'"),
    ('model.param_dtype', 'int4', "config.model.param_dtype='int4'"),
    ('model.memory_length', -1, 'config.model.memory_length=-1'),
    ('model.rnn_cell', 'elman',
     "config.model.rnn_cell='elman' must be one of ['lstm', 'gru']"),
    ('model.rnn_score', 'dot',
     "config.model.rnn_score='dot' must be one of ['additive', 'general']"),
    ('model.moe.num_experts', -2, 'config.model.moe.num_experts=-2 must be '
     'an integer >= 0'),
    ('model.moe.top_k', 0, 'config.model.moe.top_k=0 must be an integer '
     '>= 1'),
    ('model.moe.capacity_factor', 0.0, 'config.model.moe.capacity_factor='
     '0.0 must be a number > 0'),
    ('model.moe.every_n_layers', 0, 'config.model.moe.every_n_layers=0'),
    ('model.moe.group_size', -4, 'config.model.moe.group_size=-4 must be an '
     'integer >= 0'),
    ('model.moe.aux_loss_weight', -1.0, 'config.model.moe.aux_loss_weight='
     '-1.0 must be a number >= 0'),
    ('model.remat', 'sometimes', "config.model.remat='sometimes' must be one "
     "of ['none', 'full', 'dots_saveable']"),
]
# The same, on other configs: their dataset options and attention options.
INVALID_ELSEWHERE = [
    ('algorithmic', 'track_corpus', '0' * 64,
     f"config.track_corpus='{'0' * 64}' names the fingerprint of a corpus "
     "(python_stdlib_bytes and text_files); config.dataset='algorithmic' has "
     'none'),
    ('algorithmic', 'dataset_options.task', 'divide',
     "config.dataset_options.task='divide' must be one of"),
    ('algorithmic', 'dataset_options.num_train', -5,
     'config.dataset_options.num_train=-5 must be an integer >= 1'),
    ('algorithmic', 'dataset_options.max_length', 0,
     "config.dataset_options.max_length=0 must be at least 1 for task 'sort'"),
    ('algorithmic', 'dataset_options.long_max_length', 40,
     'config.dataset_options.long_max_length=40 must exceed max_length=40'),
    ('algorithmic', 'decode_splits', ('validation', 'dev'),
     "config.decode_splits names 'dev', which is not a split of config."
     "dataset='algorithmic'; it has ['long', 'train', 'validation']"),
    ('algorithmic', 'model.attention', 'linear',
     "config.decode_splits=('validation', 'long') decodes with a cache, "
     "and config.model.attention='linear' cannot decode with a cache "
     '(additive, chunked, deltanet, dense, gated_deltanet, gla, local, '
     'mamba2, mla and retnet can).'),
    ('listops', 'dataset_options.min_length', -1,
     'config.dataset_options.min_length=-1 must be an integer >= 0'),
    ('listops', 'dataset_options.max_length', 17,
     'config.dataset_options.max_length=17 must exceed min_length=16 + 1'),
    ('listops', 'dataset_options.num_train', 0,
     'config.dataset_options.num_train=0 must be an integer >= 1'),
    ('listops', 'dataset_options.num_eval', 0,
     'config.dataset_options.num_eval=0 must be an integer >= 1'),
    ('listops', 'dataset_options.max_args', 1,
     'config.dataset_options.max_args=1 must be an integer >= 2'),
    ('wmt14_ende', 'dataset_options.source_language', '',
     "config.dataset_options.source_language='' must be a language code"),
    ('wmt14_ende', 'dataset_options.target_language', 'en',
     "config.dataset_options.source_language='en' and target_language='en' "
     'must be two languages'),
    ('lm_stdlib', 'model.attention', 'strided', 'config.sample_length=300 '
     "samples with a cache, and config.model.attention='strided' cannot "
     'decode with a cache (additive, chunked, deltanet, dense, '
     'gated_deltanet, gla, local, mamba2, mla and retnet can); set it to 0.'),
    ('lm_stdlib', 'model.attention', 'dense,linear',
     "config.model.attention='linear' cannot keep packed sequences apart"),
    ('alternating', 'model.attention_options.local.window', 0,
     "config.model does not build (attention='dense,local', "
     "attention_options={'local': {'window': 0}}): window=0 must be "
     'positive'),
    ('memory_compressed', 'model.attention_options.local.window', -1,
     'window=-1 must be positive'),
    ('memory_compressed', 'model.attention_options.memory_compressed.width',
     0, 'width=0 must be positive'),
    ('memory_compressed', 'model.attention_options.memory_compressed.stride',
     4, 'stride=4 must be in [1, width=3]'),
    ('local', 'model.attention_options.kernel', 'flash',
     "config.model.attention_options.kernel='flash' must be one of ['auto', "
     "'xla', 'cudnn', 'pallas_tpu', 'pallas_gpu']"),
    ('local', 'model.attention_options.kernel', 'cudnn',
     "config.model.attention_options.kernel='cudnn' needs a GPU: the "
     "decoder's self-attention is float32, causal, packed rows, window 128 "
     "on cpu; set it to 'auto'"),
    # Windows per layer: the message gives each occurrence's.
    ('local_twice', 'model.attention_options.local.window', (64, 0),
     "config.model does not build (attention='local,local', "
     "attention_options={'local': {'window': (64, 0)}}): window=0 must be "
     'positive'),
    ('alternating', 'model.attention_options.local.kernel', 'cudnn',
     "config.model.attention_options.local.kernel='cudnn' needs a GPU"),
    ('local', 'model.attention_options.window', 0,
     "config.model does not build (attention='local', attention_options="
     "{'window': 0}): window=0 must be positive"),
    # As a config file may write it (the command line refuses the key).
    ('local', 'model.attention_options.windw', 32,
     'unknown key config.model.attention_options.windw for config.model.'
     "attention='local'; it takes ['kernel', 'scale', 'window']; did you "
     'mean window?'),
    ('local', 'model.attention_options.linear.chunk_size', 32,
     'config.model.attention_options.linear names no entry of '
     "config.model.attention='local'."),
]
# ml_collections refuses a value of another type for these, at the command
# line (exit status 2, see tests/train/run/test_trainer.py) as in code.
TYPE_CHECKED = {'pack_sequences', 'vocab_path', 'distributed',
                'cautious_weight_decay',
                'model.tie_embeddings', 'model.attention_projections',
                'model.zero_init_outputs', 'model.value_residual',
                'model.scale_tied_readout', 'model.use_bias',
                'model.scan_layers', 'model.smear', 'model.unet_skips',
                'model.attention_sinks'}


# The cases on lm_stdlib start from its baseline, whose sinusoidal positions
# every attention takes (the default's ALiBi bias some refuse).
BASELINE = functools.partial(lm_stdlib.get_config, 'baseline')
SHIPPED = {'lm_stdlib': lm_stdlib.get_config,
           'lm_stdlib:baseline': functools.partial(lm_stdlib.get_config,
                                                   'baseline'),
           **{system: functools.partial(lm_systems.get_config,
                                        f'system={system}')
              for system in lm_systems.SYSTEMS},
           'algorithmic': lambda: algorithmic.get_config('task=sort'),
           'listops': listops.get_config, 'lm1b': lm1b.get_config,
           'wmt14_ende': wmt14_ende.get_config,
           **{preset: functools.partial(published.get_config, preset)
              for preset in published.PRESETS}}


def base_config(name: str, data_dir: str):
  config = (SHIPPED[name] if name in SHIPPED and name != 'lm_stdlib'
            else BASELINE)()
  if name in ('local', 'local_twice'):
    config.model.attention = 'local' if name == 'local' else 'local,local'
  if name == 'algorithmic':  # Quick to build, where a case gets that far.
    config.dataset_options.update(num_train=200, num_eval=20)
  config.data_dir = data_dir
  return config


def config_keys(config, prefix: str = '') -> set[str]:
  """Every key of `config`, nested ones dotted; empty groups by name."""
  keys = set()
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict) and value:
      keys |= config_keys(value, f'{prefix}{key}.')
    else:
      keys.add(prefix + key)
  return keys


def test_every_key_of_every_config_has_an_invalid_case():
  """Keys all configs share are checked alike, on lm_stdlib; the dataset
  options each config sets on that config (an unset one is refused by
  name, as `dataset_options.task` is on lm_stdlib). The attention options
  are checked by name below, their values by each attention as it
  builds."""
  shared = {key for key, _, _ in INVALID} | TYPE_CHECKED
  shared |= {key.rsplit('.', 1)[0] for key in shared}  # Option groups.
  for name, get_config in SHIPPED.items():
    own = {key for base, key, _, _ in INVALID_ELSEWHERE if base == name}
    config = get_config()
    keys = {key for key in config_keys(config)
            if not key.startswith('model.attention_options.')
            and not (key.startswith('dataset_options.')
                     and config.dataset_options[key.partition('.')[2]]
                     is None)}
    assert keys <= shared | own, name
  assert len(INVALID) + len(INVALID_ELSEWHERE) >= 25


def test_the_attention_options_are_those_of_the_registered_attentions():
  options = default.get_config().model.attention_options
  types = {}
  for name in attention.names():
    assert set(options[name]) == variant_options.option_names(name)
    for option, kind in variant_options.option_types(name).items():
      assert kind in (int, float, str, bool), (name, option, kind)
      assert types.setdefault(option, kind) == kind, (name, option)
  every = set().union(*map(variant_options.option_names,
                           attention.names()))
  assert set(options) == every | set(attention.names())
  assert not every & set(attention.names())  # No option named as a group.


def test_an_attention_option_set_for_an_attention_without_it_is_refused():
  """Every option on dense (which takes scale and logit_cap alone), by its
  flat key."""
  types = {}
  for name in attention.names():
    types |= variant_options.option_types(name)
  for option, kind in sorted(types.items()):
    if option in ('scale', 'logit_cap'):
      continue
    config = BASELINE()
    config.model.attention_options[option] = kind(1)
    with pytest.raises(InputError, match=(
        f'unknown key config.model.attention_options.{option} for '
        "config.model.attention='dense'; it takes \\['logit_cap', 'scale'\\]")):
      config_validation.validate(config)


def test_typed_keys_refuse_a_value_of_another_type():
  config = lm_stdlib.get_config()
  for key in TYPE_CHECKED:
    with pytest.raises(TypeError, match='Could not override field'):
      config_overrides.apply(config, {key: 3 if 'path' in key else 'yes'})


@pytest.mark.core
@pytest.mark.parametrize(
    'base, key, value, message',
    [('lm_stdlib', *case) for case in INVALID] + INVALID_ELSEWHERE,
    ids=[f'{case[0]}={str(case[1])[:20]}' for case in INVALID]
    + [f'{base}:{key}={value}' for base, key, value, _ in INVALID_ELSEWHERE])
def test_invalid_value_exits_with_status_2_naming_its_key(
    base, key, value, message, data_dir, tmp_path, capsys):
  config = base_config(base, data_dir)
  if key == 'model.max_len':
    config.model.position = 'learned'
  config_overrides.apply(config, {key: value})
  with pytest.raises(SystemExit) as exit_:
    train.run(config, str(tmp_path))
  assert exit_.value.code == 2
  error = capsys.readouterr().err
  assert message in error
  assert 'Traceback' not in error


def test_packed_rows_need_an_attention_that_takes_any_mask():
  config = BASELINE()
  config.model.attention = 'linear'
  with pytest.raises(InputError, match='set config.pack_sequences=False'):
    config_validation.validate(config)
  config.pack_sequences = False
  config.sample_length = 0  # Sampling reads a cache, which linear cannot.
  config_validation.validate(config)


def test_decoding_inputs_longer_than_learned_positions_is_refused(
    data_dir, tmp_path, capsys):
  config = base_config('algorithmic', data_dir)
  config.model.position = 'learned'
  with pytest.raises(SystemExit) as exit_:
    train.run(config, str(tmp_path))
  assert exit_.value.code == 2
  assert ("config.decode_splits ('long') has inputs of 389 tokens, more than "
          'the 48 learned positions') in capsys.readouterr().err


def test_a_memory_needs_streams():
  config = lm_stdlib.get_config('round2')  # Without the smear.
  config.model.update(memory_length=64, position='rope')
  with pytest.raises(InputError, match='reads contiguous streams'):
    config_validation.validate(config)
  config.pack_sequences = False
  config_validation.validate(config)




def test_every_problem_of_a_config_is_reported_at_once():
  config = BASELINE()
  config.learning_rate = -1.0
  config.model.attention = 'memory_compressed'
  with pytest.raises(InputError) as error:
    config_validation.validate(config)
  lines = str(error.value).splitlines()
  assert len(lines) == 3
  assert lines[0] == 'config.learning_rate=-1.0 must be a number in (0.0, inf).'
  assert 'cannot keep packed sequences apart' in lines[1]
  assert lines[2].startswith('config.sample_length=300 samples with a '
                             'cache')


@pytest.mark.core
def test_a_missing_or_unknown_key_is_named():
  """A config file that adds a key (a typo) or drops one is refused
  before anything is built."""
  config = lm_stdlib.get_config()
  del config['seed']
  config.learning_rte = 0.1
  with pytest.raises(InputError) as error:
    config_validation.validate(config)
  assert str(error.value).splitlines() == [
      'unknown key config.learning_rte; did you mean learning_rate?',
      "config.seed is missing: a config starts from configs/default.py's "
      'get_config().']
