"""experiments/accelerator_report.py: one report whatever its parts do,
from stand-in parts that take a fraction of a second each."""

import functools
import importlib.metadata
import json
import os
import shlex
import sys
import time

import pytest

from experiments import accelerator_report, kernel_check
from experiments.accelerator_report import Part
from train import cli
from train.base.errors import InputError
from train.config import validation as config_validation

# The parts get 4 s in all, so the sleeper is stopped within about 2 s.
BUDGET_S = accelerator_report.RESERVE_S + 4
PROBE = [sys.executable, '-c', 'print(\'{"machine": "Test CPU, 2 cores", '
         '"backend": "cpu", "device_kind": "cpu"}\')']
TABLE = '# Writer results\n\n| length | ms |\n|---|---|\n| 1024 | 2.5 |\n'


def python(code: str) -> list[str]:
  return [sys.executable, '-c', code]


def stand_in_parts(out: str) -> list[Part]:
  """One that writes a table, one that prints a row and then hangs, one
  that fails."""
  table = os.path.join(out, 'writer', 'results.md')
  return [
      Part('writer', python(
          f'import os; os.makedirs({os.path.dirname(table)!r}); '
          f'open({table!r}, "w").write({TABLE!r})'), 0.5,
           functools.partial(accelerator_report.read_file, table)),
      Part('sleeper', python(
          'import time; print(\'{"length": 512, "ms": 7.5}\'); '
          'time.sleep(60)'), 0.25,
           functools.partial(accelerator_report.benchmark_markdown,
                             os.path.join(out, 'sleeper'))),
      # Its message comes from the environment it is given.
      Part('failer', python(
          'import os, sys; print("RESOURCE_EXHAUSTED: " + '
          'os.environ["REPORT_TEST"], file=sys.stderr); sys.exit(3)'),
           0.25, lambda: None, {'REPORT_TEST': 'out of memory'})]


@pytest.fixture(scope='module')
def report(tmp_path_factory):
  """(the report's text, the seconds it took, its OUT) of the stand-ins."""
  out = str(tmp_path_factory.mktemp('report'))
  start = time.monotonic()
  path = accelerator_report.run(out, budget_s=BUDGET_S, data_dir='/data',
                                parts=stand_in_parts(out), probe_argv=PROBE)
  with open(path) as f:
    return f.read(), time.monotonic() - start, out


def section(text: str, name: str) -> str:
  """The report's section of part `name`."""
  return text.split(f'## {name}\n', 1)[1].split('\n## ', 1)[0]


def test_report_names_the_machine_and_versions(report):
  text, _, _ = report
  assert 'Machine: Test CPU, 2 cores' in text
  assert 'Backend: cpu; device kind: cpu' in text
  assert f'- jax {importlib.metadata.version("jax")}' in text
  assert f'- python {sys.version.split()[0]}' in text


def test_a_part_that_ends_is_done_with_its_table(report):
  text, _, out = report
  writer = section(text, 'writer')
  assert f'Command: `{shlex.join(stand_in_parts(out)[0].argv)}`' in writer
  assert 'Status: done in' in writer
  assert '| 1024 | 2.5 |' in writer
  # Its headings sit below the report's part headings.
  assert '### Writer results' in writer


def test_a_part_past_its_time_is_stopped(report):
  text, seconds, _ = report
  assert 'Status: timed out after' in section(text, 'sleeper')
  assert seconds < BUDGET_S - accelerator_report.RESERVE_S + 1


def test_a_benchmark_cut_short_shows_the_rows_it_printed(report):
  text, _, _ = report
  sleeper = section(text, 'sleeper')
  assert 'Cut short' in sleeper
  assert '| length | ms |\n|---|---|\n| 512 | 7.5 |' in sleeper


def test_a_check_cut_short_shows_the_rows_it_printed(tmp_path):
  """The kernel check's results, else the rows it printed as each ended
  (the last cut off by the kill)."""
  out = str(tmp_path / 'kernel_check')
  with open(out + '.log', 'w') as f:
    f.write('{"kernel": "cudnn", "ok": true}\n{"kern'
            + accelerator_report.STDERR_MARK + 'Killed\n')
  assert '| cudnn | True |' in accelerator_report.results_markdown(out)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'results.md'), 'w') as f:
    f.write(TABLE)
  assert accelerator_report.results_markdown(out) == TABLE


def test_a_failed_part_shows_its_status_and_stderr(report):
  text, _, out = report
  failer = section(text, 'failer')
  assert (f"Command: `REPORT_TEST='out of memory' "
          f'{shlex.join(stand_in_parts(out)[2].argv)}`') in failer
  assert 'Status: failed with exit status 3' in failer
  assert '```text\nRESOURCE_EXHAUSTED: out of memory\n```' in failer
  assert 'It wrote no table.' in failer
  with open(os.path.join(out, 'failer.log')) as f:
    assert 'RESOURCE_EXHAUSTED' in f.read()


def test_a_budget_without_time_for_parts_is_refused(tmp_path):
  with pytest.raises(InputError, match='--budget_s=0 '):
    accelerator_report.run(str(tmp_path), budget_s=0, data_dir='/data',
                           parts=[], probe_argv=PROBE)


def test_parts_run_by_name_and_an_unknown_one_is_refused(tmp_path):
  out = str(tmp_path / 'out')
  with pytest.raises(InputError, match='--parts: no part nap, profile on '
                     'this backend; its parts are writer, sleeper, failer'):
    accelerator_report.run(out, budget_s=BUDGET_S, data_dir='/data',
                           names=['writer', 'nap', 'profile'],
                           parts=stand_in_parts(out), probe_argv=PROBE)
  assert not os.path.exists(out)
  path = accelerator_report.run(out, budget_s=BUDGET_S, data_dir='/data',
                                names=['failer', 'writer'],
                                parts=stand_in_parts(out), probe_argv=PROBE)
  with open(path) as f:
    text = f.read()
  assert '--parts=failer,writer`' in text
  # In the parts' own order, the others not run.
  assert text.index('## writer') < text.index('## failer')
  assert '## sleeper' not in text


@pytest.mark.core
def test_throughput_leaves_out_the_first_interval(tmp_path):
  lines = [{'step': 50, 'steps_per_s': 1.0, 'tokens_per_s': 100.0},
           {'step': 100, 'steps_per_s': 30.0, 'tokens_per_s': 3000.0},
           {'step': 100, 'eval_loss': 1.5, 'eval_bits_per_byte': 2.164},
           {'step': 150, 'steps_per_s': 34.0, 'tokens_per_s': 3400.0}]
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    f.writelines(json.dumps(line) + '\n' for line in lines)
  text = accelerator_report.throughput_markdown(str(tmp_path))
  assert '| 50 |' not in text
  assert '| 100 | 30 | 3000 |' in text and '| 150 | 34 | 3400 |' in text
  assert '32 steps/s on average' in text
  assert 'eval_loss 1.5, eval_bits_per_byte 2.164' in text


@pytest.mark.parametrize('backend', ['cpu', 'gpu'])
def test_the_parts_that_read_data_get_the_data_dir(backend):
  parts = accelerator_report.default_parts('/out', backend, '/data')
  reading = {part.name for part in parts
             if '--config.data_dir=/data' in part.argv}
  # On a GPU, make train's job also runs with XLA's command buffers off.
  ab = {'main_job_no_command_buffer'} if backend == 'gpu' else set()
  assert reading == {'main_job', 'main_job_16', 'profile', 'profile_gpt2',
                     'bench_input', 'bench_train'} | ab
  for part in parts:
    flags = os.environ.get('XLA_FLAGS', '').split()
    assert part.env == ({'XLA_FLAGS': ' '.join(
        flags + ['--xla_gpu_enable_command_buffer='])}
                        if part.name in ab else {})
  if backend == 'gpu':
    [bench_train] = [part for part in parts if part.name == 'bench_train']
    assert '--batch_sizes=8,32' in bench_train.argv


@pytest.mark.parametrize('backend', ['cpu', 'gpu'])
def test_every_part_that_trains_runs_a_valid_config(backend):
  """make train's jobs and the profiles: their config file with its
  overrides passes validation (the GPT-2 profile's shape replaces make
  train's attention, and must find no option of it left)."""
  parts = accelerator_report.default_parts('/out', backend, '/data')
  checked = []
  for part in parts:
    [config] = [arg[len('--config='):] for arg in part.argv
                if arg.startswith('--config=')] or [None]
    if config is None:
      continue
    overrides = dict(arg[len('--config.'):].split('=', 1)
                     for arg in part.argv if arg.startswith('--config.'))
    config_validation.validate(cli.load_config(config, overrides))
    checked.append(part.name)
  assert {'main_job', 'profile', 'profile_gpt2'} <= set(checked)


BENCH = ('| variant | ms |\n|---|---|\n| chunked[pallas_gpu] | 2.5 |\n'
         '| chunked[cudnn] | 1.0 |\n')


def checked_parts(out: str, failed) -> list[Part]:
  """A kernel check that writes `failed` as its verdict (None: writes
  none) beside a table naming pallas_gpu, then a benchmark whose rows name
  kernels."""
  check = os.path.join(out, 'kernel_check')
  verdict = os.path.join(check, kernel_check.FAILED_FILE)
  check_table = os.path.join(check, 'results.md')
  bench = os.path.join(out, 'bench', 'results.md')
  write_verdict = ('' if failed is None else
                   f'open({verdict!r}, "w").write({json.dumps(failed)!r}); ')
  return [
      Part('kernel_check', python(
          f'import os; os.makedirs({check!r}); {write_verdict}'
          f'open({check_table!r}, "w").write("| pallas_gpu | False |\\n")'),
           0.5, functools.partial(accelerator_report.read_file, check_table),
           failed_kernels=functools.partial(kernel_check.read_failed, check)),
      Part('bench', python(
          f'import os; os.makedirs({os.path.dirname(bench)!r}); '
          f'open({bench!r}, "w").write({BENCH!r})'), 0.5,
           functools.partial(accelerator_report.read_file, bench))]


# (the check's verdict, what the report says at its top).
VERDICTS = {
    'failed': ({'pallas_gpu': ['alibi bfloat16', 'plain float32']},
               '**Kernel check: failed: pallas_gpu (alibi bfloat16, plain '
               'float32). Rows below naming them are marked "(failed the '
               'device check)".**'),
    'passed': ({}, 'Kernel check: every fused kernel checked computes what '
                   'dense attention does.'),
    'none': (None, '**Kernel check: it wrote no verdict (see its section); '
                   "the fused kernels' results below are unchecked.**"),
}


@pytest.mark.parametrize('name', VERDICTS)
def test_the_rows_of_a_kernel_that_failed_the_check_are_marked(tmp_path,
                                                               name):
  """The report says at its top what the check found; a later part's rows
  naming a kernel that failed are marked, the check's own are not."""
  failed, top = VERDICTS[name]
  out = str(tmp_path)
  path = accelerator_report.run(out, budget_s=BUDGET_S, data_dir='/data',
                                parts=checked_parts(out, failed),
                                probe_argv=PROBE)
  with open(path) as f:
    text = f.read()
  assert top in text.split('\n## ', 1)[0]
  assert '| pallas_gpu | False |' in section(text, 'kernel_check')
  bench = section(text, 'bench')
  marked = '| chunked[pallas_gpu] (failed the device check) | 2.5 |'
  assert (marked in bench) == (name == 'failed')
  assert '| chunked[cudnn] | 1.0 |' in bench


@pytest.mark.core
def test_only_table_rows_naming_the_kernel_are_marked():
  markdown = ('pallas_gpu in prose\n| cudnn_packed | pallas_gpu |\n'
              '| chunked[pallas_gpu] |')
  assert accelerator_report.mark_failed(markdown, {'pallas_gpu': []}) == (
      'pallas_gpu in prose\n'
      '| cudnn_packed | pallas_gpu (failed the device check) |\n'
      '| chunked[pallas_gpu] (failed the device check) |')
  assert accelerator_report.mark_failed(markdown, {}) == markdown


@pytest.mark.parametrize('backend', ['cpu', 'gpu', 'tpu'])
def test_the_kernel_check_comes_before_every_timing_part(backend):
  first, *_ = accelerator_report.default_parts('/out', backend, '/data')
  assert first.name == 'kernel_check'
  assert first.argv[2:4] == ['experiments.kernel_check',
                             '--out=/out/kernel_check']
  assert first.failed_kernels.args == ('/out/kernel_check',)
