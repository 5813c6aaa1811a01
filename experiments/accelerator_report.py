r"""One markdown report of what the accelerator at hand does with attnlab:
first whether its fused attention kernels compute what dense attention
does (experiments/kernel_check.py), then the `make train` job's speed (one
step a call, and 16; on a GPU also with XLA's command buffers off),
profiles of its step and of GPT-2 small's (device time by kind: attention,
matmuls, readout and loss, optimizer, elementwise), training throughput
against stock Flax (GPT-2 small at batch 8 and 32 on an accelerator), and
attention against sequence length.

  python -m experiments.accelerator_report --out=DIR [--budget_s=450] \
      [--data_dir=~/tensorflow_datasets] [--parts=main_job,profile]

Each part runs in a process of its own, bounded in time, so that a hang, a
crash or an out-of-memory loses only that one; it writes under DIR/<part>/
(removed first: the training job would resume an old checkpoint), its
output goes to DIR/<part>.log. A first process says which backend is
present, which picks the parts' flags (this one never opens the
accelerator: a TPU lets only one process hold it). Each part gets its share
of the time left of --budget_s less RESERVE_S, against the shares of the
parts after it, so that time one leaves unused goes to the later ones.

Writes DIR/report.md, again after each part (what was measured survives a
kill): the date, the machine, the versions, which kernels failed the check,
and for each part its command, its status (with the end of its stderr if it
failed or timed out) and the tables it wrote, where a row of a later part
that names a kernel that failed is marked FAILED_MARK. Prints its path.
"""

from collections.abc import Callable, Mapping, Sequence
import functools
import glob
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import types
from typing import NamedTuple

from absl import flags

from configs import lm_stdlib
from experiments import bench_train, common, kernel_check
from train import cli
from train.base.errors import InputError

FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds of --budget_s no part may use: killing a late one, writing.
RESERVE_S = 20
PROBE_TIMEOUT_S = 60
STDERR_LINES = 15
# Follows a kernel's name in the rows of a part after the check.
FAILED_MARK = ' (failed the device check)'
PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'grain',
            'ml_collections')
# Prints one JSON line: the machine, the backend and its device kind.
PROBE = [sys.executable, '-c',
         'import json, jax; from experiments import common; '
         'print(json.dumps({"machine": common.machine_description(), '
         '"backend": jax.default_backend(), '
         '"device_kind": jax.devices()[0].device_kind}))']


# Each part's own flags: profiles of make train's step and of GPT-2
# small's, GPT-2 small's throughput (at llm.c's 32 rows as well as 8; the
# loop's efficiency is main_job's to say) and long attention (on plain,
# packed and padded rows, under ALiBi's and T5's biases, and capped: the
# score functions on the general kernel) on a GPU or TPU; on a CPU, short
# runs that fit --budget_s=400 on 2 cores.
ACCELERATOR_FLAGS = {
    'kernel_check': [],
    'main_job': [],
    # The same job, 16 steps a call (config.steps_per_call): the same
    # steps, logged every 64, evaluated and saved at the end only.
    'main_job_16': ['--config.steps_per_call=16', '--config.log_every=64',
                    '--config.eval_every=0', '--config.checkpoint_every=0'],
    # main_job again with XLA's GPU command buffers off (XLA_FLAGS below).
    'main_job_no_command_buffer': [],
    'profile': ['--steps=20'],
    'profile_gpt2': ['--steps=10'] + [
        f'--config.{key}={value}' for key, value in
        bench_train.size_overrides('gpt2', attention='auto',
                                   dtype='bfloat16', remat='none').items()],
    'bench_train': ['--sizes=gpt2', '--batch_sizes=8,32',
                    '--dtype=bfloat16', '--steps=10', '--noloop'],
    # The host's side of make train's job: its batches and its loop.
    'bench_input': ['--steps_per_call=1,16', '--batches=3200'],
    'bench_attention': ['--lengths=4096,16384,65536', '--dtype=bfloat16',
                        '--rows=plain,packed,padded,alibi,t5,capped']}
# XLA flags a part adds to this process's (its environment's XLA_FLAGS).
XLA_FLAGS = {'main_job_no_command_buffer': '--xla_gpu_enable_command_buffer='}
CPU_FLAGS = {
    # Interpreted, each case compiles for seconds: one dtype.
    'kernel_check': ['--dtypes=float32'],
    'main_job': [f'--config.{key}={value}' for key, value in (
        ('num_train_steps', 30), ('log_every', 10), ('eval_every', 30),
        ('checkpoint_every', 30), ('warmup_steps', 10),
        ('num_eval_steps', 10), ('sample_length', 0))],
    'main_job_16': [f'--config.{key}={value}' for key, value in (
        ('num_train_steps', 32), ('log_every', 16), ('eval_every', 0),
        ('checkpoint_every', 0), ('warmup_steps', 10),
        ('num_eval_steps', 10), ('sample_length', 0),
        ('steps_per_call', 16))],
    'profile': ['--steps=5'],
    'profile_gpt2': ['--steps=2'] + [
        f'--config.{key}={value}' for key, value in
        bench_train.size_overrides('tiny', attention='auto',
                                   dtype='float32', remat='none').items()],
    'bench_train': ['--sizes=tiny,small', '--dtype=float32', '--steps=5'],
    'bench_input': ['--steps_per_call=1,16', '--batches=320',
                    '--warmup=32'],
    'bench_attention': ['--lengths=512,1024,2048', '--dtype=float32']}
# Starts the stderr a part's log ends with.
STDERR_MARK = '\n--- stderr ---\n'


class Part(NamedTuple):
  """One measurement: a command, run in a process of its own."""
  name: str  # Its section; it writes under OUT/<name>/, logs to <name>.log.
  argv: list[str]
  # Of the time left when it starts, against the parts after it.
  share: float
  # The markdown it wrote, read back after it ended; None if none.
  markdown: Callable[[], str | None]
  # Added to this process's environment.
  env: Mapping[str, str] = types.MappingProxyType({})
  # Of a kernel check: the kernels that failed it, read back after it
  # ended ({kernel: [its failed cases]}; None if it wrote no verdict).
  failed_kernels: Callable[[], dict[str, list[str]] | None] | None = None


def read_file(path: str) -> str | None:
  """The text in `path`, or None if there is no such file."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return f.read()


def benchmark_markdown(out: str) -> str | None:
  """OUT/<backend>/results.md, else printed_markdown(out)."""
  paths = sorted(glob.glob(os.path.join(out, '*', 'results.md')))
  if paths:
    return '\n'.join(read_file(path) for path in paths)
  return printed_markdown(out)


def results_markdown(out: str) -> str | None:
  """OUT/results.md, else printed_markdown(out)."""
  return read_file(os.path.join(out, 'results.md')) or printed_markdown(out)


def printed_markdown(out: str) -> str | None:
  """Of a part cut short before writing its results, the JSON rows it
  printed as each ended (in OUT.log, before its stderr), as a table."""
  stdout = (read_file(out + '.log') or '').split(STDERR_MARK)[0]
  rows = []
  for line in stdout.splitlines():
    if line.startswith('{'):
      try:
        rows.append(json.loads(line))
      except ValueError:  # The last line, cut off by the kill.
        pass
  if not rows:
    return None
  os.makedirs(out, exist_ok=True)
  return 'Cut short; the rows it printed:\n\n' + common.write_table(
      rows, list(dict.fromkeys(key for row in rows for key in row)),
      os.path.join(out, 'partial'))


def throughput_markdown(workdir: str) -> str | None:
  """The speed of each logged interval of the run in `workdir` after the
  first (which includes compiling), and its last evaluation."""
  lines = common.read_metrics(workdir)
  intervals = [line for line in lines if 'steps_per_s' in line][1:]
  evaluations = [line for line in lines if 'eval_loss' in line]
  text = ''
  if intervals:
    mean = sum(line['steps_per_s'] for line in intervals) / len(intervals)
    text += (f'Logged intervals after the first: {mean:.4g} steps/s on '
             'average.\n\n' + common.write_table(
                 intervals, ('step', 'steps_per_s', 'tokens_per_s'),
                 os.path.join(workdir, 'throughput')))
  if evaluations:
    last = evaluations[-1]
    text += (f'\nLast evaluation, step {last["step"]}: eval_loss '
             f'{last["eval_loss"]:.4g}, eval_bits_per_byte '
             f'{last.get("eval_bits_per_byte", float("nan")):.4g}.\n')
  return text or None


def _xla_flags(flags: str) -> dict[str, str]:
  """The environment that adds `flags` to this process's XLA_FLAGS."""
  return {'XLA_FLAGS': ' '.join(filter(None, (os.environ.get('XLA_FLAGS'),
                                              flags)))}


def default_parts(out: str, backend: str, data_dir: str) -> list[Part]:
  """The parts, with the flags of `backend`: the command-buffer A/B on a
  GPU only."""
  sized = ACCELERATOR_FLAGS if backend in ('gpu', 'tpu') else CPU_FLAGS
  where = {name: os.path.join(out, name) for name in sized}
  config = ['--config=configs/lm_stdlib.py', f'--config.data_dir={data_dir}']
  module = [sys.executable, '-m']
  jobs = {'main_job': 0.25, 'main_job_16': 0.1}
  if backend == 'gpu':
    jobs['main_job_no_command_buffer'] = 0.2
  return [
      # Before any timing: a kernel that computes wrongly is not fast.
      Part('kernel_check', [*module, 'experiments.kernel_check',
                            f'--out={where["kernel_check"]}',
                            *sized['kernel_check']], 0.5,
           functools.partial(results_markdown, where['kernel_check']),
           failed_kernels=functools.partial(kernel_check.read_failed,
                                            where['kernel_check'])),
      *(Part(name, [*module, 'train.train', *config,
                    f'--workdir={where[name]}', *sized[name]], share,
             functools.partial(throughput_markdown, where[name]),
             _xla_flags(XLA_FLAGS[name]) if name in XLA_FLAGS else {})
        for name, share in jobs.items()),
      # GPT-2's shape over the second search's config, whose attention
      # has no options of its own for 'auto' to leave unread.
      *(Part(name, [*module, 'experiments.profile',
                    config[0] + (':round2' if name == 'profile_gpt2' else ''),
                    config[1], f'--workdir={where[name]}', '--warmup=3',
                    *sized[name]],
             0.1, functools.partial(read_file, os.path.join(where[name],
                                                            'profile.md')))
        for name in ('profile', 'profile_gpt2')),
      # Their --config is lm_stdlib's, built in: only the override is given.
      Part('bench_input', [*module, 'experiments.bench_input', config[1],
                           f'--out={where["bench_input"]}',
                           *sized['bench_input']], 0.05,
           functools.partial(read_file, os.path.join(where['bench_input'],
                                                     'results.md'))),
      Part('bench_train', [*module, 'experiments.bench_train', config[1],
                           f'--out={where["bench_train"]}', '--warmup=2',
                           *sized['bench_train']], 0.3,
           functools.partial(benchmark_markdown, where['bench_train'])),
      # The exact variants and the efficient ones that can be causal; a
      # variant's lengths stop growing once a step takes over a second.
      Part('bench_attention', [
          *module, 'experiments.bench_attention',
          f'--out={where["bench_attention"]}',
          '--variants=xla,dense,chunked,local,bigbird,bigbird[xla],'
          'performer,linear', '--options=bigbird.num_global_blocks=2',
          '--causal=True', '--max_seconds=1', '--reps=2',
          *sized['bench_attention']], 0.3,
           functools.partial(benchmark_markdown, where['bench_attention']))]


def probe(argv: list[str], timeout_s: float) -> dict[str, str]:
  """The machine, backend and device kind, as a process of their own
  says them ('unknown', with why, where it could not)."""
  try:
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode == 0:
      return json.loads(done.stdout.strip().splitlines()[-1])
    why = (done.stderr.strip().splitlines() or [''])[-1]
  except (subprocess.TimeoutExpired, ValueError, IndexError) as error:
    why = str(error)
  return {'machine': f'unknown (asking failed: {why})', 'backend': 'unknown',
          'device_kind': 'unknown'}


def run_part(part: Part, out: str, timeout_s: float) -> str:
  """Runs `part` for at most `timeout_s`; its status, in markdown."""
  if timeout_s < 1:
    return 'not run: the budget was spent'
  shutil.rmtree(os.path.join(out, part.name), ignore_errors=True)
  start, timed_out = time.monotonic(), False
  with open(os.path.join(out, part.name + '.log'), 'w') as log:
    # Its own session, so that a timeout also ends the processes it started.
    process = subprocess.Popen(
        part.argv, cwd=REPO, stdout=log, stderr=subprocess.PIPE, text=True,
        errors='replace', start_new_session=True,
        env=os.environ | {'PYTHONUNBUFFERED': '1'} | part.env)
    try:
      _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, signal.SIGKILL)
      _, stderr = process.communicate()
      timed_out = True
    log.write(STDERR_MARK + stderr)
  seconds = time.monotonic() - start
  if process.returncode == 0 and not timed_out:
    return f'done in {seconds:.0f} s'
  # Progress bars redraw with carriage returns: each drawing a line.
  tail = [line for line in stderr.replace('\r', '\n').splitlines()
          if line.strip()][-STDERR_LINES:]
  status = (f'timed out after {seconds:.0f} s' if timed_out else
            f'failed with exit status {process.returncode} after '
            f'{seconds:.0f} s')
  if not tail:
    return f'{status}; its stderr is empty'
  return (f'{status}; the end of its stderr:\n\n```text\n'
          + '\n'.join(tail) + '\n```')


def _header(machine: dict[str, str], command: str) -> str:
  """The title, the date, the machine, the versions and the command."""
  versions = [f'- python {platform.python_version()}']
  for package in PACKAGES:
    try:
      versions.append(f'- {package} {importlib.metadata.version(package)}')
    except importlib.metadata.PackageNotFoundError:
      versions.append(f'- {package} absent')
  return '\n'.join([
      '# Accelerator report', '', f'Date: {time.strftime("%Y-%m-%d %H:%M %Z")}',
      '', f'Machine: {machine["machine"]}', '',
      f'Backend: {machine["backend"]}; device kind: {machine["device_kind"]}',
      '', 'Versions:', '', *versions, '', f'Command: `{command}`', ''])


def mark_failed(markdown: str, kernels) -> str:
  """`markdown` with FAILED_MARK after each cell of its tables that names
  one of `kernels` (e.g. bench_attention's 'chunked[pallas_gpu]')."""
  if not kernels:
    return markdown
  name = re.compile(r'\b(' + '|'.join(map(re.escape, kernels)) + r')\b')
  mark = lambda row: '|'.join(cell.rstrip() + FAILED_MARK + ' '
                              if name.search(cell) else cell
                              for cell in row.split('|'))
  return '\n'.join(mark(line) if line.startswith('|') else line
                   for line in markdown.splitlines())


def kernel_verdict(failed: dict[str, list[str]] | None) -> str:
  """What the kernel check found, for the top of the report."""
  if failed is None:
    return ('**Kernel check: it wrote no verdict (see its section); the '
            "fused kernels' results below are unchecked.**\n")
  if not failed:
    return ('Kernel check: every fused kernel checked computes what dense '
            'attention does.\n')
  return ('**Kernel check: failed: '
          + '; '.join(f'{kernel} ({", ".join(cases)})'
                      for kernel, cases in failed.items())
          + f'. Rows below naming them are marked "{FAILED_MARK.strip()}"'
          '.**\n')


def _section(part: Part, status: str, failed: dict[str, list[str]]) -> str:
  """A part's command, status and markdown, the rows naming a kernel of
  `failed` marked, its headings put below the report's."""
  try:
    markdown = part.markdown()
  except (OSError, ValueError, KeyError) as error:
    markdown = f'Its tables could not be read: {error!r}.\n'
  if markdown is None:
    markdown = 'It wrote no table.\n'
  markdown = mark_failed(markdown, failed)
  markdown = '\n'.join('##' + line if line.startswith('#') else line
                       for line in markdown.splitlines())
  environment = ''.join(f'{key}={shlex.quote(value)} '
                        for key, value in part.env.items())
  return (f'## {part.name}\n\nCommand: `{environment}'
          f'{shlex.join(part.argv)}`\n\n'
          f'Status: {status}\n\n{markdown}\n')


def chosen(parts: list[Part], names: Sequence[str]) -> list[Part]:
  """The parts named in `names` (all of them if it is empty), in their
  order; a name that is not a part's is refused."""
  known = [part.name for part in parts]
  unknown = [name for name in names if name not in known]
  if unknown:
    raise InputError(f'--parts: no part {", ".join(unknown)} on this '
                     f'backend; its parts are {", ".join(known)}.')
  return [part for part in parts if not names or part.name in names]


def run(out: str, *, budget_s: float, data_dir: str,
        names: Sequence[str] = (), parts: list[Part] | None = None,
        probe_argv: list[str] = PROBE) -> str:
  """Runs the parts named in `names` (all if none) of `parts`
  (default_parts for the backend present, unless given) within `budget_s`;
  writes OUT/report.md and returns its path."""
  if budget_s <= RESERVE_S:
    raise InputError(f'--budget_s={budget_s:g} must be more than the '
                     f'{RESERVE_S} s kept for ending a part and writing.')
  start = time.monotonic()
  deadline = start + budget_s - RESERVE_S
  machine = probe(probe_argv, min(PROBE_TIMEOUT_S, deadline - start))
  if parts is None:
    parts = default_parts(out, machine['backend'], data_dir)
  parts = chosen(parts, names)
  os.makedirs(out, exist_ok=True)
  header = _header(machine, 'python -m experiments.accelerator_report '
                   f'--out={out} --budget_s={budget_s:g} --data_dir={data_dir}'
                   + (f' --parts={",".join(names)}' if names else ''))
  path, sections = os.path.join(out, 'report.md'), []
  # The kernels that failed the check, and its verdict (none if none ran).
  failed, verdict = {}, []

  def write(*footer: str) -> None:
    with open(path, 'w') as f:
      f.write('\n'.join([header, *verdict, *sections, *footer]))

  write()
  for i, part in enumerate(parts):
    left = deadline - time.monotonic()
    share = part.share / sum(later.share for later in parts[i:])
    status = run_part(part, out, left * share)
    print(f'{part.name}: {status.splitlines()[0]}', flush=True)
    sections.append(_section(part, status, failed))
    if part.failed_kernels is not None:
      found = part.failed_kernels()
      failed, verdict = found or {}, [kernel_verdict(found)]
    write()
  write(f'The report took {time.monotonic() - start:.0f} s; the parts\' '
        f'output is in {out}/<part>.log.\n')
  return path


def main(argv: list[str]) -> None:
  cli.run_main(argv, lambda: print(run(
      FLAGS.out, budget_s=FLAGS.budget_s, data_dir=FLAGS.data_dir,
      names=FLAGS.parts)))


def _define_flags() -> None:
  """The command line, defined only when this runs as a script."""
  flags.DEFINE_string('out', None, 'The report goes to OUT/report.md, each '
                      'part\'s files under OUT/<part>/.')
  flags.DEFINE_float('budget_s', 450.0, 'Seconds the whole report may take.')
  flags.DEFINE_string('data_dir', lm_stdlib.get_config().data_dir,
                      'The dataset\'s directory, forwarded as '
                      '--config.data_dir.')
  flags.DEFINE_list('parts', [], 'The parts to run, by name (e.g. '
                    'main_job,profile); all of them if none.')
  flags.mark_flag_as_required('out')


if __name__ == '__main__':
  cli.run(main, _define_flags)
