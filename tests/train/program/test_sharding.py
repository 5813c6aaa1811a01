"""One train step on any mesh (train/program/mesh.py, sharding.py): layouts
agree with one device, fused kernels split like the model, checkpoints
move between meshes, bad layouts are refused, two processes train as
one."""

import json
import os
import socket
import subprocess
import sys

import chex
import grain
import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from configs import default, lm_stdlib
from model import layer_stack
from tests.helpers import REPO
from tests.helpers import config_overrides
from train.base.errors import InputError
from train.base.train_config import TrainConfig
from train.config import validation as config_validation
from train.run import checkpointing, trained_run
from train.run.program import Program
from train.run.trainer import train_and_evaluate


B, T, V = 8, 16, 64


def small_config(**parallelism):
  config = default.get_config()
  config.batch_size = B
  config.seq_len = T
  config.warmup_steps = 1
  # Plain SGD, unclipped: a gradient of the wrong scale changes the losses.
  config.update(optimizer='sgd', grad_clip_norm=0.0, learning_rate=0.5)
  config.model.update(vocab_size=V, d_model=32, num_heads=4, num_layers=2,
                      mlp_dim=64, max_len=T, position='rope')
  config.parallelism.update(parallelism)
  return config


def lm_batches(count: int):
  """Packed LM batches: two documents a row, with segment ids."""
  rng = np.random.default_rng(0)
  for _ in range(count):
    tokens = rng.integers(1, V, (B, T + 1)).astype(np.int32)
    split = T // 2 - 3
    segments = np.where(np.arange(T) < split, 1, 2).astype(np.int32)
    segments = np.broadcast_to(segments, (B, T)).copy()
    positions_ = np.where(np.arange(T) < split, np.arange(T),
                          np.arange(T) - split).astype(np.int32)
    yield {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
           'positions': np.broadcast_to(positions_, (B, T)).copy(),
           'segment_ids': segments,
           'weights': np.ones((B, T), np.float32)}


def program_for(config, devices):
  return Program.from_config(config, devices)


def train(program, steps: int = 5, state=None):
  """(losses and gradient norms of `steps` steps from `state` (default: a
  fresh one), final state)."""
  state = program.init() if state is None else state
  losses = []
  with program.scope():
    for batch in lm_batches(steps):
      state, sums = program.train_step(state, program.batch(batch),
                                       program.key(1))
      losses.append(float(sums['loss_sum'] / sums['weight_sum']))
      losses.append(float(sums['grad_norm']))
  return losses, state


@pytest.fixture(scope='module')
def one_device_losses():
  return train(program_for(small_config(), jax.devices()[:1]))[0]


def query_kernel(state):
  return state.params['decoder']['block_0']['self_attention']['query'][
      'kernel']


LAYOUTS = {
    'data8': (dict(data=8), None),
    'fsdp8': (dict(data=1, fsdp=8), None),
    'data2_fsdp2_tensor2': (dict(data=2, fsdp=2, tensor=2), None),
    'data4_sequence2_ring': (dict(data=4, sequence=2), 'ring'),
    'pmap_data8': (dict(data=8, strategy='pmap'), None),
}


@pytest.mark.parametrize('name', LAYOUTS)
def test_layout_trains_like_one_device(name, one_device_losses):
  layout, attention_name = LAYOUTS[name]
  config = small_config(**layout)
  if attention_name:
    config.model.attention = attention_name
  losses, state = train(program_for(config, jax.devices()))
  np.testing.assert_allclose(losses, one_device_losses, rtol=1e-5)
  assert losses[-2] < losses[0]  # It learns.
  # The query kernel [embed 32, heads 4, head_dim 8] on each device: split
  # by FSDP along embed, by tensor parallelism along heads.
  shard_shape = {'data8': (32, 4, 8), 'fsdp8': (4, 4, 8),
                 'data2_fsdp2_tensor2': (16, 2, 8),
                 'data4_sequence2_ring': (32, 4, 8),
                 'pmap_data8': (32, 4, 8)}[name]
  kernel = query_kernel(state)
  assert {s.data.shape for s in kernel.addressable_shards} == {shard_shape}
  if name == 'fsdp8':
    leaves = jax.tree.leaves(state.params)
    total = sum(x.nbytes for x in leaves)
    on_device_0 = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    assert on_device_0 < 0.15 * total  # 1/8, plus the unsplit biases.


def scanned_config(**parallelism):
  config = small_config(**parallelism)
  config.model.scan_layers = True
  return config


def test_scanned_blocks_train_as_one_by_one_under_fsdp_and_tensor_rules():
  """From the same parameters, a scanned stack on 2 x 2 x 2 devices takes
  the steps one device takes with the unscanned stack; its stacked
  parameters are split by the same rules, the layers axis whole."""
  plain = program_for(small_config(), jax.devices()[:1])
  scanned = program_for(scanned_config(data=2, fsdp=2, tensor=2),
                        jax.devices())
  start = plain.init()
  params = jax.device_get(start.params)  # Before the steps donate them.
  want, _ = train(plain, state=start)
  got, state = train(scanned, state=scanned.start_from(layer_stack.relayout(
      params, scanned.abstract_state.params)))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # The query kernels of the 2 layers [2, embed 32, heads 4, head_dim 8].
  kernel = state.params['decoder']['layers']['block_0']['self_attention'][
      'query']['kernel']
  assert {s.data.shape for s in kernel.addressable_shards} == {(2, 16, 2, 8)}


def test_experts_spread_over_devices_by_a_logical_axis_rule():
  """('expert', 'fsdp') before the default rules gives each of the 4 fsdp
  devices one of 4 experts (expert parallelism); the steps equal one
  device's."""
  def moe_config(**parallelism):
    config = small_config(**parallelism)
    config.model.moe.update(num_experts=4, top_k=2, every_n_layers=1)
    config.logical_axis_rules = (('expert', 'fsdp'),) + (
        TrainConfig().logical_axis_rules)
    return config

  want, _ = train(program_for(moe_config(), jax.devices()[:1]))
  got, state = train(program_for(moe_config(data=2, fsdp=4), jax.devices()))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  experts = state.params['decoder']['block_0']['moe']['wi']  # [4, 32, 64]
  assert {s.data.shape for s in experts.addressable_shards} == {(1, 32, 64)}


def test_the_optimizers_statistics_are_split_like_their_parameters():
  """Muon's momentum and AdamW's moments, each held for some parameters
  (the others masked by optax.partition), are placed as those parameters
  are under FSDP, not replicated."""
  config = small_config(data=1, fsdp=8)
  config.optimizer = 'muon'
  state = program_for(config, jax.devices()).state_sharding
  placed = {jax.tree_util.keystr(path): sharding for path, sharding
            in jax.tree_util.tree_leaves_with_path(state.params)}
  statistics = {}
  for path, sharding in jax.tree_util.tree_leaves_with_path(state.opt_state):
    name = jax.tree_util.keystr(path)
    of = [param for param in placed if name.endswith('.mu' + param)]
    if of:
      [param] = of
      assert sharding == placed[param], name
      statistics[param] = sharding.spec
  query = "['decoder']['block_0']['self_attention']['query']['kernel']"
  embedding = "['embedder']['token_embedding']['embedding']"
  assert set(statistics) == set(placed)
  assert statistics[query] == P('fsdp', 'tensor', None)
  assert 'fsdp' in statistics[embedding]


def compiled_step(kernel: str, model: dict, **parallelism):
  """(the params after one step of chunked attention on `kernel`, its
  metric sums, its compiled HLO) under the trainer's own rules."""
  config = small_config(**parallelism)
  config.model.update(attention='chunked',
                      attention_options={'kernel': kernel}, **model)
  program = program_for(config, jax.devices())
  batch = program.batch(next(lm_batches(1)))
  with program.scope():
    step = program.train_step.lower(program.abstract_state, batch,
                                    program.key(1)).compile()
    state, sums = step(program.init(), batch, program.key(1))
  return state.params, sums, step.as_text()


# name: (mesh, config.model's changes, the fused kernels compared with
# xla).
FUSED_LAYOUTS = {
    # The examples split (over_shards is the same for both kernels).
    'data8': (dict(data=8), {}, ('pallas_gpu',)),
    # The heads split too; ALiBi's slopes and the sinks with them, its
    # positions by example; heads of 16, which the general kernel takes.
    'data2_tensor4_alibi_sinks': (
        dict(data=2, tensor=4),
        dict(position='alibi', attention_sinks=True, d_model=64),
        ('pallas_tpu', 'pallas_gpu')),
}


@pytest.mark.parametrize('name', FUSED_LAYOUTS)
def test_fused_kernels_split_like_the_model_under_the_trainers_rules(name):
  """Each Pallas kernel (interpreted) in a train step on packed rows: the
  same loss and updated parameters (SGD: the gradients) as the xla kernel,
  and no more all-gathers: each device computes its own examples' heads."""
  layout, model, kernels = FUSED_LAYOUTS[name]
  params, sums, hlo = compiled_step('xla', model, **layout)
  for kernel in kernels:
    got_params, got_sums, got_hlo = compiled_step(kernel, model, **layout)
    np.testing.assert_allclose(got_sums['loss_sum'], sums['loss_sum'],
                               rtol=1e-5)
    chex.assert_trees_all_close(got_params, params, atol=1e-5, rtol=1e-7)
    assert got_hlo.count('all-gather(') <= hlo.count('all-gather('), kernel


# --- checkpoints across meshes ---


@pytest.mark.parametrize('save_on, restore_on', [('fsdp8', 'one'),
                                                 ('one', 'fsdp8')])
def test_checkpoint_restores_onto_another_mesh(save_on, restore_on, tmp_path):
  layouts = {'fsdp8': (dict(data=1, fsdp=8), jax.devices()),
             'one': (dict(), jax.devices()[:1])}
  source = program_for(small_config(**layouts[save_on][0]),
                       layouts[save_on][1])
  _, state = train(source, steps=1)
  iterator = iter(grain_iterator())
  next(iterator), next(iterator), next(iterator)
  checkpointer = checkpointing.Checkpointer(str(tmp_path), keep=1)
  checkpointer.save(1, state, iterator)
  checkpointer.close()

  target = program_for(small_config(**layouts[restore_on][0]),
                       layouts[restore_on][1])
  checkpointer = checkpointing.Checkpointer(str(tmp_path), keep=1)
  restored_iterator = iter(grain_iterator())
  restored = checkpointer.restore(1, target.abstract_state,
                                  restored_iterator)
  checkpointer.close()
  assert next(restored_iterator) == next(iterator) == 3
  for got, want, placed in zip(
      jax.tree.leaves(restored), jax.tree.leaves(state),
      jax.tree.leaves(target.state_sharding)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == placed
  num_devices = len(query_kernel(restored).sharding.device_set)
  assert num_devices == (8 if restore_on == 'fsdp8' else 1)


@pytest.mark.parametrize('scanned', ['saved', 'restored'])
def test_a_checkpoint_restores_into_the_other_layout_of_the_blocks(
    scanned, tmp_path):
  """A run that switches config.model.scan_layers resumes from its
  checkpoints: Muon's state and the parameters, verified as saved, are
  converted exactly and placed as the new program asks."""
  def muon(config):
    config.optimizer = 'muon'
    return config
  one = program_for(muon(small_config()), jax.devices()[:1])
  fsdp = program_for(muon(scanned_config(data=1, fsdp=8)), jax.devices())
  source, target = (fsdp, one) if scanned == 'saved' else (one, fsdp)
  _, state = train(source, steps=1)
  checkpointer = checkpointing.Checkpointer(str(tmp_path), keep=1)
  checkpointer.save(1, state, iter(grain_iterator()))
  checkpointer.close()

  checkpointer = checkpointing.Checkpointer(str(tmp_path), keep=1)
  restored = checkpointer.restore(1, target.abstract_state)
  checkpointer.close()
  want = layer_stack.relayout(jax.device_get(state), target.abstract_state)
  assert (jax.tree.structure(restored)
          == jax.tree.structure(target.abstract_state))
  for got, expected, placed in zip(
      jax.tree.leaves(restored), jax.tree.leaves(want),
      jax.tree.leaves(target.state_sharding)):
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert got.sharding == placed
  # A reader's restore of the parameters alone converts them alike.
  _, params = trained_run.restore_params(str(tmp_path),
                                         target.abstract_state.params)
  for got, expected, placed in zip(
      jax.tree.leaves(params), jax.tree.leaves(want.params),
      jax.tree.leaves(target.state_sharding.params)):
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert got.sharding == placed


def grain_iterator():
  return grain.MapDataset.range(10).to_iter_dataset()


# --- refused layouts ---

BAD_LAYOUTS = [
    (dict(data=3), 'config.parallelism: data=3'),
    (dict(data=-1, fsdp=-1), 'only one axis may be -1'),
    (dict(data=-1, tensor=3), 'config.parallelism.data=-1'),
    (dict(data=2, tensor=4, model=dict(num_heads=6, d_model=48)),
     'config.model.num_heads=6 does not split over '
     'config.parallelism.tensor=4'),
    (dict(data=8, batch_size=12), 'config.batch_size=12'),
    (dict(data=2, sequence=4, seq_len=18), 'config.seq_len=18'),
    (dict(data=2, fsdp=4, strategy='pmap'), 'config.parallelism.fsdp=4'),
    (dict(strategy='pmapp'), 'config.parallelism.strategy'),
    (dict(rules=(('embed', 'model'),)), 'config.logical_axis_rules'),
    (dict(dcn_data=2), 'config.parallelism.dcn_data=2'),
]


@pytest.mark.core
@pytest.mark.parametrize('overrides, message', BAD_LAYOUTS)
def test_bad_layouts_are_refused_naming_the_key(overrides, message):
  overrides = dict(overrides)
  config = small_config()
  config.model.update(overrides.pop('model', {}))
  if 'batch_size' in overrides:
    config.batch_size = overrides.pop('batch_size')
  if 'seq_len' in overrides:
    config.seq_len = config.model.max_len = overrides.pop('seq_len')
  if 'rules' in overrides:
    config.logical_axis_rules = overrides.pop('rules')
  config.parallelism.update(overrides)
  with pytest.raises(InputError, match=message.replace('(', r'\(')):
    config_validation.validate(config)


# --- two processes ---

TWO_PROCESS_OVERRIDES = {
    'num_train_steps': 30, 'warmup_steps': 1, 'batch_size': 8, 'seq_len': 32,
    'log_every': 1, 'eval_every': 0, 'checkpoint_every': 0,
    'num_eval_steps': 1, 'sample_length': 4, 'model.num_layers': 1,
    'model.d_model': 32, 'parallelism.fsdp': 2,
    # One layer: no first layer's values to mix into a later one's.
    'model.value_residual': False}


def train_losses(workdir) -> list[float]:
  """Training losses by step; a resumed run's lines replace the first's."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    lines = [json.loads(line) for line in f if '"loss"' in line]
  return list({line['step']: line['loss'] for line in lines}.values())


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def run_processes(flags: list[str], interrupts=(None, None)) -> list[str]:
  """The output of a process per entry of `interrupts` (a cue of
  tests/helpers/interrupted_train.py, or None), each with 4 CPU devices,
  together one run; each must exit with status 0. They compile as the
  suite does (tests/conftest.py's XLA_FLAGS), with 4 devices, not 8."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=os.environ[
      'XLA_FLAGS'].replace('device_count=8', 'device_count=4'))
  if len(interrupts) > 1:
    flags = flags + [f'--coordinator_address=127.0.0.1:{free_port()}',
                     f'--num_processes={len(interrupts)}']
  commands = [[sys.executable, '-m', 'train.train'] if cue is None else
              [sys.executable, 'tests/helpers/interrupted_train.py',
               f'--interrupt={cue}'] for cue in interrupts]
  processes = [subprocess.Popen(
      command + flags + ([f'--process_id={i}'] if len(commands) > 1 else []),
      cwd=REPO, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i, command in enumerate(commands)]
  try:
    outputs = [process.communicate(timeout=300)[0] for process in processes]
  finally:
    for process in processes:
      process.kill()
  for process, output in zip(processes, outputs):
    assert process.returncode == 0, output[-3000:]
  return outputs


@pytest.mark.slow
def test_two_processes_stop_together_and_one_resumes_as_one_would_train(
    tmp_path, data_dir, stdlib_dataset):
  """SIGTERM to one host: the preemption service has both save the same
  step and exit 0, each host having read only its half of each batch's
  rows; one process resumes from their checkpoint (every row's data
  position in it) and finishes as one process would have."""
  del stdlib_dataset  # Built once here, so the processes only read it.
  flags = ['--config=configs/lm_stdlib.py', f'--config.data_dir={data_dir}',
           f'--workdir={tmp_path / "two"}']
  flags += [f'--config.{key}={value}'
            for key, value in TWO_PROCESS_OVERRIDES.items()]
  first, second = run_processes(flags, interrupts=(None, 'term:2'))
  assert 'Host 0 of 2 prepares rows 0-3 of each training batch of 8.' in first
  assert 'Host 1 of 2 prepares rows 4-7 of each training batch of 8.' in second
  checkpointer = checkpointing.Checkpointer(str(tmp_path / 'two'), keep=1,
                                            read_only=True)
  saved = checkpointer.latest_step()
  checkpointer.close()
  assert saved is not None and 2 <= saved < 30, first[-3000:]
  assert (f'a preemption notice: saved the checkpoint of step {saved}'
          in first)
  resumed, = run_processes(flags, interrupts=(None,))
  assert f'Resumed from the checkpoint at step {saved}.' in resumed
  assert '--- sample' in resumed

  config = config_overrides.apply(lm_stdlib.get_config(),
                                  TWO_PROCESS_OVERRIDES)
  config.data_dir = data_dir
  train_and_evaluate(config, str(tmp_path / 'one'))
  one = train_losses(tmp_path / 'one')
  assert len(one) == TWO_PROCESS_OVERRIDES['num_train_steps']
  np.testing.assert_allclose(train_losses(tmp_path / 'two'), one, rtol=1e-5)
