"""experiments/profile.py: a short run read back from its trace, and the
interval arithmetic its tables rest on."""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import profile
from model.layers import ATTENTION_SCOPE
from tests.helpers.tiny_runs import tiny_config
from train.base.errors import InputError
from train.program.steps import LOSS_SCOPE, OPTIMIZER_SCOPE


def covered_ns(intervals):
  """Brute force: the integer nanoseconds that some interval covers."""
  covered = set()
  for start, end in intervals:
    covered |= set(range(start, end))
  return covered


def test_merged_length_counts_overlapping_time_once():
  rng = np.random.default_rng(0)
  for _ in range(50):
    starts = rng.integers(0, 100, size=rng.integers(0, 8))
    intervals = [(int(s), int(s + d)) for s, d in
                 zip(starts, rng.integers(0, 30, size=len(starts)))]
    assert profile.merged_length(intervals) == len(covered_ns(intervals))


def test_self_times_leave_out_what_runs_inside():
  # A while loop (0-10) around two ops, one with an op inside; then a
  # separate op. Ties: an op starting where its parent starts is inside.
  intervals = [(12, 15), (0, 10), (0, 4), (1, 2), (6, 9)]
  assert profile.self_times(intervals) == [3, 10 - 4 - 3, 4 - 1, 1, 3]
  # Whatever the nesting, the self times add up to the covered time.
  for order in itertools.permutations(intervals):
    assert sum(profile.self_times(order)) == len(covered_ns(order))


def test_busy_fraction_is_per_device_and_averaged():
  def op(device, track, start, end):
    return profile.Op(device, track, 'fusion.1', 'jit_step', start, end)
  ops = [op('a', 's0', 0, 6), op('a', 's1', 4, 8),  # Overlap: 0-8 busy.
         op('b', 's2', 15, 30),  # Half inside the window.
         op('a', 's0', 25, 40)]  # Outside.
  window = (0, 20)
  assert profile.busy_fraction(ops, window, ['a', 'b']) == (
      pytest.approx((8 / 20 + 5 / 20) / 2))
  # A device that ran nothing in the window counts as idle.
  assert profile.busy_fraction(ops, window, ['a', 'b', 'c']) == (
      pytest.approx((8 / 20 + 5 / 20) / 3))


def test_kernels_group_instances_and_count_self_time_per_device():
  ops = [profile.Op('d0', 't', 'while.2', 'jit_step', 0, 10),
         profile.Op('d0', 't', 'fusion.1', 'jit_step', 1, 4),
         profile.Op('d0', 't', 'fusion.7', 'jit_step', 5, 8),
         profile.Op('d1', 'u', 'loop_add_fusion_3', 'jit_step', 0, 2)]
  rows = profile.kernel_rows(ops, (0, 10), num_steps=2, num_devices=2)
  by_kernel = {row['kernel']: row for row in rows}
  assert [row['kernel'] for row in rows] == ['fusion', 'while',
                                            'loop_add_fusion']
  assert by_kernel['fusion']['count_per_step'] == 2 / 4
  assert by_kernel['fusion']['ms_per_step'] == pytest.approx(6e-6 / 4)
  assert by_kernel['while']['share'] == pytest.approx(4 / 12)
  assert sum(row['share'] for row in rows) == pytest.approx(1.0)
  # XLA's suffix of a Triton kernel compiled twice.
  assert profile.kernel_name('flex_dq__1') == 'flex_dq'


def test_host_rows_count_an_annotation_inside_its_namesake_once():
  spans = [profile.Span('PjitFunction(step)', 0, 10),
           profile.Span('PjitFunction(step)', 2, 8),
           profile.Span('ParseArguments', 3, 4),
           profile.Span('next_batch', 12, 30)]  # Cut at the window's end.
  rows = profile.host_rows(spans, (0, 20), num_steps=2)
  # The inner PjitFunction adds no inclusive time; self times: the outer
  # 10 - 6, the inner 6 - 1, ParseArguments 1. Two steps.
  assert [row['name'] for row in rows] == [
      'PjitFunction(step)', 'next_batch', 'ParseArguments']
  expected = [(2 / 2, 10 / 2, (10 - 6 + 6 - 1) / 2), (1 / 2, 8 / 2, 8 / 2),
              (1 / 2, 1 / 2, 1 / 2)]
  for row, (count, inclusive_ns, self_ns) in zip(rows, expected):
    assert row['count_per_step'] == count
    assert row['ms_per_step'] == pytest.approx(inclusive_ns / 1e6)
    assert row['self_ms_per_step'] == pytest.approx(self_ns / 1e6)


def xspace(planes: dict) -> str:
  """A text-format XSpace of {plane: {line: [(event, start_ns, end_ns,
  {stat: int or str})]}}."""
  text = []
  for plane_id, (plane, lines) in enumerate(planes.items()):
    names, stats, body = {}, {}, []
    for line_id, (line, events) in enumerate(lines.items()):
      body.append(f'lines {{ id: {line_id} name: "{line}" timestamp_ns: 0')
      for name, start, end, values in events:
        event_id = names.setdefault(name, len(names) + 1)
        body.append(f'events {{ metadata_id: {event_id} offset_ps: '
                    f'{start * 1000} duration_ps: {(end - start) * 1000}')
        for key, value in values.items():
          field = ('str_value: "%s"' if isinstance(value, str)
                   else 'int64_value: %d') % value
          body.append(f'stats {{ metadata_id: '
                      f'{stats.setdefault(key, len(stats) + 1)} {field} }}')
        body.append('}')
      body.append('}')
    body += [f'event_metadata {{ key: {i} value {{ id: {i} name: "{name}" }} }}'
             for name, i in names.items()]
    body += [f'stat_metadata {{ key: {i} value {{ id: {i} name: "{name}" }} }}'
             for name, i in stats.items()]
    text.append(f'planes {{ id: {plane_id} name: "{plane}" '
                + '\n'.join(body) + '}')
  return '\n'.join(text)


def test_a_gpu_trace_is_read_from_its_device_plane():
  module = {'hlo_module': 'jit_train_step'}
  data = jax.profiler.ProfileData.from_text_proto(xspace({
      '/host:CPU': {'python': [
          ('train', 0, 100, {'step_num': 1}),
          ('train', 100, 200, {'step_num': 2}),
          ('train', 200, 250, {'step_num': 3}),
          ('next_batch', 150, 170, {}),
          # A host-side op record: the device plane has the op.
          ('fusion.3', 120, 130, {'hlo_op': 'fusion.3'})]},
      '/device:GPU:0': {
          'Stream #1(Kernel)': [('sm90_xmma_gemm', 110, 150, module),
                                ('loop_add_fusion_2', 160, 170, module)],
          'Stream #2(MemcpyH2D)': [('MemcpyH2D', 140, 175, {})],
          'CUPTI overhead': [('overhead', 100, 200, {})]}}))
  result = profile.summarize(profile.read_trace(data), warmup=1,
                             num_steps=1)
  assert result['step_ms'] == pytest.approx(100e-6)
  assert result['num_devices'] == 1
  assert result['device_busy_fraction'] == pytest.approx((175 - 110) / 100)
  assert [(row['kernel'], row['program'], row['ms_per_step'])
          for row in result['kernels']] == [
              ('sm90_xmma_gemm', 'jit_train_step', pytest.approx(40e-6)),
              ('MemcpyH2D', '', pytest.approx(35e-6)),
              ('loop_add_fusion', 'jit_train_step', pytest.approx(10e-6))]
  assert [row['name'] for row in result['host']] == ['next_batch']


def test_profile_of_a_tiny_run(data_dir, tmp_path):
  workdir = str(tmp_path)
  # 1 + 2 + 1 steps: the 4 of tiny_config, so that its programs, compiled
  # by the other tests' runs, come from the compilation cache.
  result = profile.run(tiny_config('lm_stdlib', data_dir), workdir, steps=2,
                       warmup=1,
                       config_path='tests/helpers/tiny_runs.py tiny_config')
  assert os.path.exists(result['trace'])
  assert result['trace'].startswith(os.path.join(workdir, 'trace'))
  assert result['step_ms'] > 0
  assert 0 < result['device_busy_fraction'] <= 1
  assert result['num_devices'] == 8  # tests/conftest.py's CPU devices.
  programs = {row['program'] for row in result['kernels']}
  assert 'jit_train_step' in programs
  assert all(row['ms_per_step'] > 0 for row in result['kernels'])
  # Every kind of the step's work shows, with all of the devices' time.
  kinds = {row['kind']: row for row in result['kinds']}
  assert {'attention', 'matmuls', 'readout and loss', 'optimizer',
          'collectives', 'elementwise'} <= set(kinds)
  assert sum(row['share'] for row in kinds.values()) == pytest.approx(1.0)
  names = {row['name'] for row in result['host']}
  assert 'next_batch' in names and profile.STEP_NAME not in names
  with open(os.path.join(workdir, 'profile.md')) as f:
    report = f.read()
  assert '2 steps measured after 1' in report
  assert '| kernel | program |' in report and '| name |' in report
  assert '| kind | count_per_step |' in report
  with open(os.path.join(workdir, 'hlo', 'jit_train_step.txt')) as f:
    assert f.readline().startswith('HloModule jit_train_step')


@pytest.mark.core
def test_steps_and_warmup_below_one_name_the_flag(tmp_path):
  with pytest.raises(InputError, match='--steps=0'):
    profile.run(None, str(tmp_path), steps=0, warmup=1)
  with pytest.raises(InputError, match='--warmup=0'):
    profile.run(None, str(tmp_path), steps=1, warmup=0)


def test_op_kinds_come_from_scopes_opcodes_and_fusions():
  mesh = jax.make_mesh((8,), ('data',))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))

  def step(x_BxD, w_DxD):
    with jax.named_scope(ATTENTION_SCOPE):
      a_BxD = jax.nn.softmax(x_BxD @ w_DxD.T)
    h_BxD = jnp.tanh(a_BxD @ w_DxD) * 3.0
    with jax.named_scope(LOSS_SCOPE):
      loss = jnp.sum(jnp.exp(h_BxD))  # Summed over devices: all-reduce.
    with jax.named_scope(OPTIMIZER_SCOPE):
      return loss, w_DxD - 0.1 * loss * jnp.sign(w_DxD)

  x = jax.device_put(jnp.ones((64, 32)), rows)
  compiled = jax.jit(step).lower(x, jnp.ones((32, 32))).compile()
  kinds = profile.op_kinds(compiled.as_text())
  assert {program for program, _ in kinds} == {'jit_step'}
  assert {'attention', 'matmuls', 'readout and loss', 'optimizer',
          'collectives'} <= set(kinds.values()) <= set(profile.KINDS)


def test_kind_rows_add_self_time_by_kind():
  kinds = {('jit_step', 'while.1'): 'elementwise',
           ('jit_step', 'fusion.12'): 'matmuls',
           ('jit_step', 'all-reduce.3'): 'collectives'}
  ops = [profile.Op('d0', 't', 'while.1', 'jit_step', 0, 10, 'while.1'),
         profile.Op('d0', 't', 'fusion.12', 'jit_step', 1, 5, 'fusion.12'),
         # A GPU kernel without an hlo_op stat: named after its fusion.
         profile.Op('d1', 'u', 'fusion_12', 'jit_step', 0, 2, 'fusion_12'),
         profile.Op('d1', 'u', 'all-reduce.3', 'jit_step', 2, 3,
                    'all-reduce.3'),
         profile.Op('d1', 'v', 'MemcpyH2D', '', 0, 4, 'MemcpyH2D'),
         # In a command buffer, hlo_op names the buffer: the kernel's name
         # says the instruction, unless it is a library's.
         profile.Op('d1', 'w', 'fusion_12', 'jit_step', 0, 1,
                    'command_buffer_1'),
         profile.Op('d1', 'w', 'sm90_xmma_gemm_f32f32', 'jit_step', 1, 4,
                    'command_buffer_1')]
  rows = profile.kind_rows(ops, (0, 10), num_steps=1, num_devices=2,
                           kinds=kinds)
  assert [(row['kind'], row['count_per_step'], row['ms_per_step'])
          for row in rows] == [
              ('matmuls', 1.5, pytest.approx(7e-6 / 2)),
              ('collectives', 0.5, pytest.approx(1e-6 / 2)),
              ('elementwise', 0.5, pytest.approx(6e-6 / 2)),
              (profile.UNIDENTIFIED, 0.5, pytest.approx(3e-6 / 2)),
              ('outside the step', 0.5, pytest.approx(4e-6 / 2))]
  assert sum(row['share'] for row in rows) == pytest.approx(1.0)


# A GPU program's text, cut down: a command buffer called from the entry
# (as XLA versions that write one into the program do) holding a GEMM
# fusion and Pallas kernels (Triton calls; one kernel called in two
# scopes), an async all-reduce with its reducer, a fusion in the
# optimizer's scope, and names with and without XLA's '%'.
GPU_HLO = '''HloModule jit_train_step, entry_computation_layout={(bf16[8,8]{1,0})->(f32[8,8]{1,0}, /*index=1*/f32[8,8]{1,0})}

%fused_computation (p0: bf16[8,8], p1: bf16[8,8]) -> f32[8,8] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  %p1 = bf16[8,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp(loss))/dot_general"}
}

%command_buffer (p: bf16[8,8]) -> f32[8,8] {
  %p = bf16[8,8]{1,0} parameter(0)
  %pallas_call.7 = f32[8,8]{1,0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp(DecoderLM)/block_0/self_attention/attention_core/flex_dq/pallas_call"}, backend_config={debug = false, grid_x = 4 : i32, ir = "ML\\EFR\\0D", name = "flex_dq", num_stages = 2 : i32}
  %pallas_call.8 = f32[8,8]{1,0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp(DecoderLM)/block_0/self_attention/attention_core/pallas_call"}, backend_config={name = "shared"}
  %pallas_call.9 = f32[8,8]{1,0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/optimizer/pallas_call"}, backend_config={name = "shared"}
  ROOT %gemm_fusion_dot.3 = f32[8,8]{1,0} fusion(%p, %p), kind=kCustom, calls=%fused_computation, metadata={op_name="jit(train_step)/transpose(jvp(loss))/dot_general"}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

fused_multiply (q0: f32[8,8]) -> f32[8,8] {
  q0 = f32[8,8]{1,0} parameter(0)
  ROOT multiply.2 = f32[8,8]{1,0} multiply(q0, q0), metadata={op_name="jit(train_step)/optimizer/mul"}
}

ENTRY %main.9 (x: bf16[8,8]) -> (f32[8,8], /*index=1*/f32[8,8]) {
  %x = bf16[8,8]{1,0} parameter(0), metadata={op_name="x"}
  %call.4 = f32[8,8]{1,0} call(%x), to_apply=%command_buffer
  %all-reduce-start.2 = f32[8,8]{1,0} all-reduce-start(%call.4), replica_groups={}, to_apply=%add, metadata={op_name="jit(train_step)/transpose(jvp(loss))/dot_general"}
  %all-reduce-done.2 = f32[8,8]{1,0} all-reduce-done(%all-reduce-start.2)
  loop_multiply_fusion = f32[8,8]{1,0} fusion(%all-reduce-done.2), kind=kLoop, calls=fused_multiply, metadata={op_name="jit(train_step)/optimizer/mul"}
  ROOT %tuple.5 = (f32[8,8]{1,0}, f32[8,8]{1,0}) tuple(%all-reduce-done.2, loop_multiply_fusion)
}
'''


def test_op_kinds_read_a_gpu_program_with_command_buffers():
  kinds = {name: kind for (program, name), kind in
           profile.op_kinds(GPU_HLO).items() if program == 'jit_train_step'}
  assert kinds['gemm_fusion_dot.3'] == 'readout and loss'
  assert kinds['all-reduce-start.2'] == kinds['all-reduce-done.2'] == (
      'collectives')
  assert kinds['loop_multiply_fusion'] == 'optimizer'
  assert kinds['call.4'] == 'elementwise'
  assert kinds['pallas_call.7'] == kinds['flex_dq'] == 'attention'
  # A kernel whose calls differ in kind is no key of its own.
  assert kinds['pallas_call.9'] == 'optimizer' and 'shared' not in kinds
  # What runs inside a fusion is no op of its own.
  assert 'dot.1' not in kinds and 'multiply.2' not in kinds
  # An op of a trace that names no program: the one program's.
  [row] = profile.kind_rows(
      [profile.Op('d0', 't', 'gemm_fusion_dot_3', '', 0, 5,
                  'gemm_fusion_dot_3')], (0, 10), num_steps=1,
      num_devices=1, kinds=profile.op_kinds(GPU_HLO))
  assert row['kind'] == 'readout and loss'
  # In a command buffer, a Pallas kernel by its name, XLA's suffix aside.
  [row] = profile.kind_rows(
      [profile.Op('d0', 't', 'flex_dq__1', 'jit_train_step', 0, 5,
                  'command_buffer_1')], (0, 10), num_steps=1,
      num_devices=1, kinds=profile.op_kinds(GPU_HLO))
  assert row['kind'] == 'attention'
