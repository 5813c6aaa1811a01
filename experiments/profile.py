r"""Where a training step's time goes: a short real run under the JAX
profiler, read back into tables. What to run first when a step is slow.

  python -m experiments.profile --config=configs/lm_stdlib.py --workdir=DIR \
      [--steps=10] [--warmup=2] [--config.key=value ...]

Trains the config `warmup + steps + K` steps through `train_and_evaluate`
(K: config.steps_per_call, of which `warmup` and `steps` are multiples)
in DIR/run (removed first: it is this command's scratch run), inside
`jax.profiler.trace(DIR/trace)` (also removed first), with no periodic
evaluation, checkpoint or sample, and the learning-rate warmup cut to fit
the run. train/run/trainer.py marks each call (K steps) with
`jax.profiler.StepTraceAnnotation('train', step_num=<its first step>)`;
the measured window runs from the start of step warmup + 1 to the start of
step warmup + steps + 1, and every figure is per step (the window's time
over `steps`). So the first `warmup` steps (compiling) are left out, and
so is the last call, which holds the one log line, the closing evaluation
and the checkpoint.

What counts as a device op: on GPU and TPU, the events of the device planes
(/device:GPU:0, ...: a GPU's streams, or a TPU's 'XLA Ops' line); on CPU,
where XLA's "devices" run on the host's threads, the thunk executions, which
are the host events that carry an `hlo_op` stat and are named after the HLO
instruction (fusion.12, dot.3, all-reduce.1). With CPU devices simulated
(--xla_force_host_platform_device_count), an all-reduce's time is mostly its
wait for the other devices' threads.

Writes DIR/profile.md (the command, the machine, the config, then the
tables), the tables alone in DIR/kinds.{md,csv}, DIR/kernels.{md,csv} and
DIR/host.{md,csv}, the compiled programs' text in DIR/hlo/<module>.txt, and
prints the report:
  - step time: the window over the measured steps;
  - device busy: the union of each device's op intervals in the window over
    the window (ops overlapping on several streams or threads counted
    once), averaged over the devices;
  - kinds: device time by what the ops do (attention, matmuls, readout and
    loss, optimizer, collectives, elementwise, in the step but
    unidentified, outside the step), per step and per device, self time;
    each op's kind is read from the compiled train step's text (its
    opcode, what a fusion holds, and the name scope its op name passes
    through: see `op_kinds`), which the trainer hands over as it compiles;
    a library's kernel in a GPU command buffer names no instruction;
  - kernels: device time by kernel, numeric suffixes stripped so that
    fusion.1 and fusion.2 are one row, per step and per device, self time
    (an op inside another, as a loop body inside its while, counts once);
  - host: the main thread's annotations (jit dispatch, 'next_batch', the
    metrics fetch) by name, per step, inclusive and self time.
The trace itself opens in TensorBoard's or XProf's profile viewer.
"""

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
import glob
import os
import re
import shutil
import sys
from typing import Any, NamedTuple

from absl import flags
import jax
import ml_collections
from ml_collections import config_flags

from experiments import common
from model.layers import ATTENTION_SCOPE
from train import cli
from train.base.errors import InputError
from train.program.steps import LOSS_SCOPE, OPTIMIZER_SCOPE
from train.run.trainer import train_and_evaluate

FLAGS = flags.FLAGS

# The name train/run/trainer.py gives its StepTraceAnnotation.
STEP_NAME = 'train'
KERNEL_ROWS = 15
HOST_ROWS = 10
KERNEL_COLUMNS = ('kernel', 'program', 'count_per_step', 'ms_per_step',
                  'share')
HOST_COLUMNS = ('name', 'count_per_step', 'ms_per_step', 'self_ms_per_step')
KIND_COLUMNS = ('kind', 'count_per_step', 'ms_per_step', 'share')
# A kernel of the step that no instruction is named after: a library's
# (cuBLAS's, a memset) inside a GPU command buffer.
UNIDENTIFIED = 'in the step, unidentified'
# What a device op does, by its HLO instruction in the compiled train step
# (see `op_kinds`), in the order the table lists them.
KINDS = ('attention', 'matmuls', 'readout and loss', 'optimizer',
         'collectives', 'elementwise', UNIDENTIFIED, 'outside the step')
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
               'ragged-all-to-all', 'collective-permute',
               'collective-broadcast')


class Op(NamedTuple):
  """One device op (kernel) execution; times in ns on the trace's clock."""
  device: str  # '/device:GPU:0', or 'cpu:3' for a CPU device ordinal.
  track: str  # The stream or thread: ops nest only within one.
  name: str
  program: str  # The HLO module, e.g. 'jit_train_step'; '' if unknown.
  start_ns: float
  end_ns: float
  # The HLO instruction it runs (the trace's hlo_op, else its name).
  instruction: str = ''


class Span(NamedTuple):
  """One annotation on the main host thread; times in ns."""
  name: str
  start_ns: float
  end_ns: float


class Trace(NamedTuple):
  """What the profile reads from a trace."""
  steps: dict[int, tuple[float, float]]  # step_num: (start_ns, end_ns).
  devices: tuple[str, ...]  # Every device that ran an op.
  ops: list[Op]
  host: list[Span]  # The thread of the steps, less the steps and ops.


# --- Interval arithmetic, on (start, end) pairs in ns ---

def merged_length(intervals: Iterable[tuple[float, float]]) -> float:
  """The length of the union of the intervals."""
  total, reach = 0.0, float('-inf')
  for start, end in sorted(intervals):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total


def self_times(intervals: Sequence[tuple[float, float]]) -> list[float]:
  """Each interval's length less that of the intervals directly inside it,
  in the order given. The intervals are one thread's (or stream's): any two
  are nested or disjoint."""
  result = [end - start for start, end in intervals]
  stack = []
  for i in sorted(range(len(intervals)),
                  key=lambda i: (intervals[i][0], -intervals[i][1])):
    start, end = intervals[i]
    while stack and intervals[stack[-1]][1] <= start:
      stack.pop()
    if stack:
      result[stack[-1]] -= min(end, intervals[stack[-1]][1]) - start
    stack.append(i)
  return result


def clipped(events: Iterable, window: tuple[float, float]) -> list:
  """The events (Op or Span) that overlap the window, cut to it."""
  low, high = window
  return [event._replace(start_ns=max(event.start_ns, low),
                         end_ns=min(event.end_ns, high))
          for event in events
          if event.end_ns > low and event.start_ns < high]


# --- Reading the trace ---

def _stats(event) -> dict:
  return dict(event.stats)


def _device_lines(plane) -> list:
  """A device plane's lines of ops: a TPU's 'XLA Ops' line (its other
  lines, modules and steps, span those ops again), else a GPU's streams."""
  lines = list(plane.lines)
  ops = [line for line in lines if line.name == 'XLA Ops']
  return ops or [line for line in lines
                 if line.name != 'CUPTI overhead'
                 and not line.name.startswith('_')]


def read_trace(data) -> Trace:
  """The steps, device ops and main-thread annotations of a
  `jax.profiler.ProfileData`."""
  steps, host_ops, device_ops, lines = {}, [], [], {}
  step_track = None
  for plane_index, plane in enumerate(data.planes):
    if re.fullmatch(r'/device:(GPU|TPU):\d+', plane.name):
      for line_index, line in enumerate(_device_lines(plane)):
        device_ops += [
            Op(plane.name, f'{plane_index}/{line_index}', event.name,
               str(_stats(event).get('hlo_module', '')), event.start_ns,
               event.end_ns,
               str(_stats(event).get('hlo_op', '')) or event.name)
            for event in line.events if event.duration_ns > 0]
    elif plane.name.startswith('/host:'):
      for line_index, line in enumerate(plane.lines):
        track = f'{plane_index}/{line_index}'
        lines[track] = line
        for event in line.events:
          stats = _stats(event)
          if event.name == STEP_NAME and 'step_num' in stats:
            steps[int(stats['step_num'])] = (event.start_ns, event.end_ns)
            step_track = track
          elif 'hlo_op' in stats:
            host_ops.append(Op(f'cpu:{stats.get("device_ordinal", 0)}',
                               track, event.name,
                               str(stats.get('hlo_module', '')),
                               event.start_ns, event.end_ns,
                               str(stats['hlo_op'])))
  # A GPU's or TPU's host threads may annotate ops too; its planes say what
  # the device did.
  ops = device_ops or host_ops
  host = []
  if step_track is not None:
    for event in lines[step_track].events:
      # 'end: <op>' marks where the CPU thunk executor saw an op finish.
      if (event.duration_ns > 0 and event.name != STEP_NAME
          and not event.name.startswith('end: ')
          and 'hlo_op' not in _stats(event)):
        host.append(Span(event.name, event.start_ns, event.end_ns))
  return Trace(steps, tuple(sorted({op.device for op in ops})), ops, host)


def step_window(steps: dict[int, tuple[float, float]], *, warmup: int,
                num_steps: int) -> tuple[float, float]:
  """(start, end) in ns of the measured steps: from the start of step
  warmup + 1 to the start of step warmup + num_steps + 1."""
  first, after = warmup + 1, warmup + num_steps + 1
  missing = [step for step in (first, after) if step not in steps]
  if missing:
    raise RuntimeError(
        f'The trace has no {STEP_NAME!r} step annotation of step(s) '
        f'{missing} (it has {sorted(steps)}); train/run/trainer.py marks each '
        f'step with jax.profiler.StepTraceAnnotation({STEP_NAME!r}, '
        'step_num=<step>).')
  return steps[first][0], steps[after][0]


# --- What each op does, from the compiled program's text ---

_HEADER = re.compile(r'HloModule\s+([\w.\-]+)')
# A computation's first line: unindented, ending with its opening brace.
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$')
# The opcode: the first lower-case word before a parenthesis after the
# shape (f32[8]{0}, a tuple (f32[], s32[]), a layout {1,0:T(8,128)}).
_OPCODE = re.compile(r'(?:^|\s)([a-z][a-z0-9\-]*)\(')
_CALLS = re.compile(r'\bcalls=%?([\w.\-]+)')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# A Triton call's kernel (a Pallas kernel on a GPU): the name in its
# backend_config, an MLIR attribute dictionary ({..., name = "flex_dq"}).
_KERNEL = re.compile(r'[{,]\s*name = "([^"]*)"')


class _Instruction(NamedTuple):
  opcode: str
  op_name: str  # The JAX name stack: jit(train_step)/jvp(DecoderLM)/...
  calls: str  # A fusion's computation; '' if none.
  target: str  # A custom call's target; '' if none.
  kernel: str  # A Triton call's kernel name; '' if none.


def _parse_hlo(text: str) -> tuple[str, dict[str, dict[str, _Instruction]]]:
  """(module name, {computation: {instruction: _Instruction}}) of a
  compiled program's text (`jax.stages.Compiled.as_text()`)."""
  header = _HEADER.search(text)
  computations, current = {}, None
  for line in text.splitlines():
    instruction = _INSTRUCTION.match(line)
    if line[:1].isspace() and instruction and current is not None:
      name, rest = instruction.groups()
      opcode = _OPCODE.search(rest)
      fields = [pattern.search(rest) for pattern in (_OP_NAME, _CALLS,
                                                     _TARGET, _KERNEL)]
      current[name] = _Instruction(
          opcode.group(1) if opcode else '',
          *(field.group(1) if field else '' for field in fields))
    elif computation := _COMPUTATION.match(line):
      current = computations.setdefault(computation.group(1), {})
  return (header.group(1) if header else ''), computations


def _is_matmul(instruction: _Instruction, computations) -> bool:
  """A dot, a convolution, a GEMM library call, or a fusion of one."""
  if instruction.opcode in ('dot', 'convolution'):
    return True
  if instruction.opcode == 'custom-call':
    return any(word in instruction.target.lower()
               for word in ('gemm', 'matmul'))
  return any(_is_matmul(inner, computations) for inner in
             computations.get(instruction.calls, {}).values())


def _in_scope(op_name: str, scope: str) -> bool:
  """Whether the name stack (its first, where fusion joined several with
  ';') passes through the name scope `scope`."""
  return scope in re.split(r'[/()]', op_name.split(';')[0])


def op_kinds(text: str) -> dict[tuple[str, str], str]:
  """{(program, instruction): kind} of every instruction of a compiled
  train step's text that runs as an op (not inside a fusion). The kind, of
  KINDS: collectives by opcode; then by the name scope the op comes from
  (the optimizer update and the loss over the readout's logits, in
  train/program/steps.py; the attention function's call, in
  model/layers.py); then matmuls (dots, GEMM calls and their fusions);
  elementwise for the rest (norms, activations, residuals, casts,
  copies, reductions). A Triton call's kernel name is a key too, with its
  calls' kind where they agree: inside a command buffer a Pallas kernel's
  trace names only the kernel."""
  module, computations = _parse_hlo(text)
  # A fusion's computation runs inside its op. Every other computation's
  # instructions may run as ops: a while loop's body, and on a GPU a
  # command buffer's (`call`), where XLA writes one into the program.
  inside = {instruction.calls for body in computations.values()
            for instruction in body.values()
            if instruction.opcode == 'fusion'}
  kinds, by_kernel = {}, defaultdict(set)
  for computation, body in computations.items():
    if computation in inside:
      continue
    for name, instruction in body.items():
      if instruction.opcode.removesuffix('-start').removesuffix(
          '-done') in COLLECTIVES:
        kind = 'collectives'
      elif _in_scope(instruction.op_name, OPTIMIZER_SCOPE):
        kind = 'optimizer'
      elif _in_scope(instruction.op_name, LOSS_SCOPE):
        kind = 'readout and loss'
      elif _in_scope(instruction.op_name, ATTENTION_SCOPE):
        kind = 'attention'
      elif _is_matmul(instruction, computations):
        kind = 'matmuls'
      else:
        kind = 'elementwise'
      kinds[module, name] = kind
      if instruction.kernel and 'triton' in instruction.target:
        by_kernel[instruction.kernel].add(kind)
  # An instruction of the same name as a kernel keeps its own kind.
  return {(module, kernel): kind for kernel, (kind, *others)
          in by_kernel.items() if not others} | kinds


# --- Tables ---

def kernel_name(name: str) -> str:
  """`name` less a numeric suffix: fusion.12 (CPU), loop_add_fusion_3 (a
  GPU kernel) and flex_dq__1 (a Triton kernel) are instances of fusion,
  loop_add_fusion and flex_dq."""
  return re.sub(r'(__|[._])\d+$', '', name)


def busy_fraction(ops: Iterable[Op], window: tuple[float, float],
                  devices: Sequence[str]) -> float:
  """The fraction of the window each device spends in at least one op,
  averaged over `devices` (one that ran nothing in it counts as idle)."""
  by_device = defaultdict(list)
  for op in clipped(ops, window):
    by_device[op.device].append((op.start_ns, op.end_ns))
  length = window[1] - window[0]
  return sum(merged_length(by_device[device]) for device in devices) / (
      length * max(len(devices), 1))


def _self_time_by(ops: Iterable[Op], window: tuple[float, float],
                  key: Callable[[Op], Any]) -> tuple[dict, dict]:
  """({key: count}, {key: self time in ns}) of the ops in the window."""
  by_track = defaultdict(list)
  for op in clipped(ops, window):
    by_track[op.track].append(op)
  counts, times = defaultdict(int), defaultdict(float)
  for track_ops in by_track.values():
    for op, time in zip(track_ops, self_times(
        [(op.start_ns, op.end_ns) for op in track_ops])):
      counts[key(op)] += 1
      times[key(op)] += time
  return counts, times


def kernel_rows(ops: Iterable[Op], window: tuple[float, float],
                num_steps: int, num_devices: int) -> list[dict]:
  """Device self time by (kernel, program) in the window, most first: count
  and ms per step and per device, and share of all the ops' time."""
  counts, times = _self_time_by(
      ops, window, lambda op: (kernel_name(op.name), op.program))
  total = sum(times.values()) or 1.0
  per_step = num_steps * max(num_devices, 1)
  return [{'kernel': kernel, 'program': program,
           'count_per_step': counts[kernel, program] / per_step,
           'ms_per_step': times[kernel, program] / 1e6 / per_step,
           'share': times[kernel, program] / total}
          for kernel, program in sorted(times, key=times.get, reverse=True)]


def kind_rows(ops: Iterable[Op], window: tuple[float, float],
              num_steps: int, num_devices: int,
              kinds: dict[tuple[str, str], str]) -> list[dict]:
  """Device self time by kind (KINDS) in the window, in KINDS' order: count
  and ms per step and per device, and share of all the ops' time. `kinds`:
  {(program, instruction): kind} of the train step's programs (`op_kinds`);
  an op of one of them that names no instruction of it (a library's
  kernel in a command buffer: cuBLAS's, a memset) is
  UNIDENTIFIED, and any other op (a transfer, another program's) 'outside
  the step'. An op whose trace names no program is looked up in the one
  program, if only one was compiled."""
  programs = {program for program, _ in kinds}
  alone = next(iter(programs)) if len(programs) == 1 else None

  def kind(op: Op) -> str:
    program = op.program or alone
    # A GPU kernel is named after its instruction (fusion.12 as fusion_12);
    # its hlo_op stat names the instruction too, except in a command
    # buffer (a CUDA graph), where it names the buffer (command_buffer_1);
    # a Triton kernel by its name, which XLA may suffix (flex_dq__1).
    for name in (op.instruction, op.name,
                 re.sub(r'_(\d+)$', r'.\1', op.name),
                 re.sub(r'__\d+$', '', op.name)):
      if (program, name) in kinds:
        return kinds[program, name]
    return UNIDENTIFIED if op.program in programs else 'outside the step'

  counts, times = _self_time_by(ops, window, kind)
  total = sum(times.values()) or 1.0
  per_step = num_steps * max(num_devices, 1)
  return [{'kind': name, 'count_per_step': counts[name] / per_step,
           'ms_per_step': times[name] / 1e6 / per_step,
           'share': times[name] / total}
          for name in KINDS if name in times]


def host_rows(spans: Iterable[Span], window: tuple[float, float],
              num_steps: int) -> list[dict]:
  """The main thread's annotations in the window by name, most inclusive
  time first: count, inclusive and self ms per step."""
  spans = clipped(spans, window)
  intervals, own = defaultdict(list), defaultdict(float)
  for span, time in zip(spans, self_times(
      [(span.start_ns, span.end_ns) for span in spans])):
    intervals[span.name].append((span.start_ns, span.end_ns))
    own[span.name] += time
  # A union: an annotation inside one of the same name (a jitted function
  # calling itself through its wrapper) adds no time.
  inclusive = {name: merged_length(named)
               for name, named in intervals.items()}
  return [{'name': name,
           'count_per_step': len(intervals[name]) / num_steps,
           'ms_per_step': inclusive[name] / 1e6 / num_steps,
           'self_ms_per_step': own[name] / 1e6 / num_steps}
          for name in sorted(inclusive, key=inclusive.get, reverse=True)]


def summarize(trace: Trace, *, warmup: int, num_steps: int,
              kinds: dict[tuple[str, str], str] | None = None) -> dict:
  """step_ms, device_busy_fraction, kernels (top rows), host (top rows),
  num_devices and, given `kinds` (see `kind_rows`), kinds (rows) of the
  measured steps of `trace`."""
  window = step_window(trace.steps, warmup=warmup, num_steps=num_steps)
  return {
      'kinds': kind_rows(trace.ops, window, num_steps, len(trace.devices),
                         kinds) if kinds else [],
      'step_ms': (window[1] - window[0]) / 1e6 / num_steps,
      'device_busy_fraction': busy_fraction(trace.ops, window,
                                            trace.devices),
      'num_devices': len(trace.devices),
      'kernels': kernel_rows(trace.ops, window, num_steps,
                             len(trace.devices))[:KERNEL_ROWS],
      'host': host_rows(trace.host, window, num_steps)[:HOST_ROWS]}


# --- The run ---

def trace_file(directory: str) -> str:
  """The one XSpace file jax.profiler.trace wrote under `directory`."""
  paths = glob.glob(os.path.join(directory, '**', '*.xplane.pb'),
                    recursive=True)
  if len(paths) != 1:
    raise RuntimeError(f'Expected one *.xplane.pb under {directory}, found '
                       f'{paths}.')
  return paths[0]


def _save_hlo(text: str, workdir: str) -> str:
  """Writes a compiled program's text to workdir/hlo/<its module>.txt
  (where a kernel's instruction is looked up); returns the text."""
  os.makedirs(os.path.join(workdir, 'hlo'), exist_ok=True)
  header = _HEADER.search(text)
  module = header.group(1) if header else 'program'
  with open(os.path.join(workdir, 'hlo', f'{module}.txt'), 'w') as f:
    f.write(text)
  return text


def run(config: ml_collections.ConfigDict, workdir: str, *, steps: int,
        warmup: int, config_path: str = '', command: str = '') -> dict:
  """Profiles `steps` training steps of `config` after `warmup` in
  `workdir` (see the module docstring); returns `summarize`'s dict, with
  'trace': the path of the trace file."""
  if steps < 1:
    raise InputError(f'--steps={steps} must be at least 1.')
  if warmup < 1:
    raise InputError(f'--warmup={warmup} must be at least 1: the first step '
                     'compiles.')
  per_call = config.steps_per_call
  for flag, value in (('steps', steps), ('warmup', warmup)):
    if value % per_call:
      raise InputError(
          f'--{flag}={value} must be a multiple of config.steps_per_call='
          f'{per_call}: the window starts and ends with a call.')
  run_dir = os.path.join(workdir, 'run')
  trace_dir = os.path.join(workdir, 'trace')
  for directory in (run_dir, trace_dir, os.path.join(workdir, 'hlo')):
    shutil.rmtree(directory, ignore_errors=True)
  # The Python tracer (on by default) records every Python call: a trace
  # hundreds of times larger, and steps it slows down.
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  kinds = {}
  with jax.profiler.trace(trace_dir, profiler_options=options):
    # The one log line falls in the last call, outside the window.
    total = warmup + steps + per_call
    train_and_evaluate(
        common.timed_run_config(config, num_train_steps=total,
                                log_every=total), run_dir,
        on_compiled=lambda compiled: kinds.update(
            op_kinds(_save_hlo(compiled.as_text(), workdir))))
  path = trace_file(trace_dir)
  result = summarize(read_trace(jax.profiler.ProfileData.from_file(path)),
                     warmup=warmup, num_steps=steps, kinds=kinds)
  result['trace'] = path
  print(write_report(result, workdir, steps=steps, warmup=warmup,
                     config_path=config_path, command=command))
  return result


def write_report(result: dict, workdir: str, *, steps: int, warmup: int,
                 config_path: str, command: str) -> str:
  """Writes workdir/profile.md, kinds.{md,csv}, kernels.{md,csv} and
  host.{md,csv}; returns the markdown of profile.md."""
  kinds = common.write_table(result['kinds'], KIND_COLUMNS,
                             os.path.join(workdir, 'kinds'))
  kernels = common.write_table(result['kernels'], KERNEL_COLUMNS,
                               os.path.join(workdir, 'kernels'))
  host = common.write_table(result['host'], HOST_COLUMNS,
                            os.path.join(workdir, 'host'))
  report = (
      '# Profile of a training step\n\n'
      + (f'Command: `{command}`\n\n' if command else '')
      + f'Machine: {common.machine_description()}\n\n'
      + (f'Config: {config_path}\n\n' if config_path else '')
      + f'Trace: {result["trace"]}\n\n'
      f'{steps} steps measured after {warmup}: **{result["step_ms"]:.4g} ms '
      f'a step**; the devices ({result["num_devices"]}) are busy '
      f'**{result["device_busy_fraction"]:.1%}** of it.\n\n'
      '## Device time by kind (per step and per device; self time)\n\n'
      + kinds +
      f'\n## Device time by kernel (top {KERNEL_ROWS}; per step and per '
      'device; self time)\n\n' + kernels
      + f'\n## Main host thread by annotation (top {HOST_ROWS}; per step; '
      'ms inclusive of nested annotations, self_ms not)\n\n' + host)
  with open(os.path.join(workdir, 'profile.md'), 'w') as f:
    f.write(report)
  return report


def main(argv: list[str]) -> None:
  cli.run_main(argv, lambda: run(
      FLAGS.config, common.local_workdir(FLAGS.workdir), steps=FLAGS.steps,
      warmup=FLAGS.warmup,
      config_path=config_flags.get_config_filename(FLAGS['config']),
      command='python -m experiments.profile ' + ' '.join(sys.argv[1:])))


def _define_flags() -> None:
  """The command line, defined only when this runs as a script."""
  config_flags.DEFINE_config_file(
      'config', 'configs/lm_stdlib.py',
      'Training config file to profile, optionally with :argument.',
      lock_config=True)
  flags.DEFINE_string('workdir', None,
                      'The profile goes here: run/ (a scratch run), trace/, '
                      'profile.md and the tables\' .md and .csv files.')
  flags.DEFINE_integer('steps', 10, 'Steps measured.')
  flags.DEFINE_integer('warmup', 2, 'Steps first, not measured (the first '
                       'compiles).')
  flags.mark_flag_as_required('workdir')


if __name__ == '__main__':
  cli.run(main, _define_flags)
