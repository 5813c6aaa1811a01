"""The trials of a sweep or a study: the config file's `get_sweep()`,
every trial's config checked before any runs, and one trial run as a
process of its own with its record (DIR/<trial>/trial.json). A library
that experiments/sweep.py (grids, and the command line) and
experiments/study.py (searches) build on; it imports neither.

A trial's record holds its wall time, the sum over every run of it (an
attempt), and is rewritten as an attempt goes, so that the time of one
whose supervisor (the sweep, the speedrun) was killed is counted too. The
trial's process dies with its supervisor (Linux): it gets SIGTERM, saves
and stops, and the next run of the command resumes it.
"""

from collections.abc import Callable, Sequence
import ctypes
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import warnings

from configs import search
from experiments import common
from train import cli
from train.base.errors import InputError, did_you_mean
from train.config import validation as config_validation
from train.data import datasets
from train.run import metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Exit status of a search's trial (experiments/trial.py) that its pruner
# stopped.
PRUNED = 3
# Exit statuses of a trial stopped by a signal before it could save (the
# signal came during its start, or twice): it resumes from its last
# checkpoint, as one stopped after saving (exit status 0) does.
INTERRUPTED = (130, -signal.SIGINT, -signal.SIGTERM)
# Seconds between the rewrites of a running trial's record.
RECORD_EVERY_S = 1.0
# Looked up once here: between fork and exec a child only calls it.
_PRCTL = (ctypes.CDLL(None, use_errno=True).prctl
          if sys.platform.startswith('linux') else None)
PR_SET_PDEATHSIG = 1
# The fork that starts a trial's process (for its preexec_fn) runs no JAX
# before its exec: JAX's warning of a fork does not apply to it.
warnings.filterwarnings('ignore', message='os.fork', category=RuntimeWarning,
                        module='subprocess')


def load_sweep(config_arg: str) -> list[dict] | search.Space:
  """The config file's get_sweep(): a grid's trials, or a search space;
  InputError for a file without one, or one that cannot be built."""
  cli.load_config(config_arg, {})  # The file exists and gives a config.
  path = config_arg.split(':', 1)[0]
  spec = importlib.util.spec_from_file_location('sweep_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_sweep'):
    raise InputError(f'--config={config_arg}: {path} defines no get_sweep() '
                     '(a list of override dicts, configs/grid.py, or a '
                     'search space, configs/search.py).')
  try:
    return module.get_sweep()
  except ValueError as error:  # A distribution or space out of its range.
    raise InputError(f'--config={config_arg}: get_sweep(): {error}') from None


def check_trials(config_arg: str, trials: list[dict], common_overrides: dict,
                 metric: str | None, mode: str | None
                 ) -> tuple[str | None, str | None]:
  """Reads and validates every trial's config, as its train.train would,
  and the metric; InputError naming every problem. Returns the metric and
  its mode (None, None: the task's quality metric, chosen afterwards)."""
  problems, config = {}, None  # Each problem, with the trials it is in.
  for trial in trials:
    try:
      config = cli.load_config(config_arg, common_overrides | trial)
      config_validation.validate(config)
    except InputError as error:
      for line in str(error).splitlines():
        problems.setdefault(line, []).append(trial_name(trial))
  if problems:
    raise InputError('\n'.join(
        problem if len(names) == len(trials) else
        f'trial {" and ".join(names)}: {problem}'
        for problem, names in problems.items()))
  if metric is None:
    return None, None
  known = metrics.final_summary(datasets.task_of(config.dataset),
                                config.decode_splits)
  if metric not in known:
    raise InputError(f'--metric={metric}: no trial logs it'
                     f'{did_you_mean(metric, known)}')
  if (mode or known[metric]) is None:
    raise InputError(f'--mode: say whether --metric={metric} is better low '
                     '(min) or high (max).')
  return metric, mode or known[metric]


def trial_name(overrides: dict) -> str:
  """'learning_rate=0.001,warmup_steps=100', safe as a directory name."""
  text = ','.join(f'{key}={value}' for key, value in overrides.items())
  return re.sub(r'[^A-Za-z0-9_.,=+-]', '_', text) or 'default'


def _dies_with(supervisor: int) -> Callable[[], None] | None:
  """The preexec_fn that makes a child get SIGTERM when `supervisor` (this
  process; strictly, the thread that starts the child, which waits in it
  for the child's end) dies, even by kill -9; None off Linux."""
  if _PRCTL is None:
    return None

  def preexec() -> None:
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor:  # It died before that took effect.
      os.kill(os.getpid(), signal.SIGTERM)
  return preexec


def _earlier_seconds(record: dict | None, workdir: str) -> float:
  """The wall time of a trial's earlier attempts. One whose supervisor
  died left its record as last rewritten (status running): its process
  went on to the last line of its log (its save, after the SIGTERM)."""
  if record is None:
    return 0.0
  if record['status'] != 'running':
    return record['seconds']
  ended = os.path.getmtime(os.path.join(workdir, 'log.txt'))
  return record['seconds'] + max(0.0, ended - record['counted_to'])


def run_trial(config_arg: str, workdir: str, overrides: dict,
              common_overrides: dict, parallel: int = 1, *,
              module: str = 'train.train', extra: Sequence[str] = (),
              env: dict[str, str] | None = None) -> dict:
  """Runs one trial to its end (or reads its record); returns the record,
  whose status is finished, stopped (by a signal, after saving), pruned
  (`module` exited with PRUNED) or failed, and whose seconds are those of
  every attempt. `extra` and `env`: more arguments and environment
  variables of `module`, not part of what the record compares."""
  command = [sys.executable, '-m', module, f'--config={config_arg}',
             f'--workdir={workdir}']
  command += [f'--config.{key}={value}'
              for key, value in (common_overrides | overrides).items()]
  record_path = os.path.join(workdir, 'trial.json')
  record = common.load_json(record_path)
  if record is not None:
    if record['command'] != command[1:]:
      raise InputError(f'{workdir} holds a trial run as '
                       f'{" ".join(record["command"])}; sweep in a new '
                       '--workdir to change the overrides.')
    if record['status'] in ('finished', 'pruned'):
      return record
  os.makedirs(workdir, exist_ok=True)
  env = os.environ | (env or {})
  if parallel > 1:  # Trials on one accelerator share its memory.
    env.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', f'{0.9 / parallel:.2f}')
  earlier = _earlier_seconds(record, workdir)
  record = {'overrides': overrides, 'command': command[1:]}
  started = time.perf_counter()

  def counted() -> None:  # The record as it goes.
    common.save_json(record_path, record | {
        'status': 'running', 'counted_to': time.time(),
        'seconds': earlier + time.perf_counter() - started})
  with open(os.path.join(workdir, 'log.txt'), 'a') as log:
    counted()
    with subprocess.Popen(command + list(extra), cwd=REPO, env=env,
                          stdout=log, stderr=subprocess.STDOUT,
                          preexec_fn=_dies_with(os.getpid())) as process:
      while True:
        try:
          process.wait(timeout=RECORD_EVERY_S)
          break
        except subprocess.TimeoutExpired:
          counted()
  record['seconds'] = earlier + time.perf_counter() - started
  evaluations = [line for line in common.read_metrics(workdir)
                 if 'eval_loss' in line]
  # A run stopped by SIGTERM or SIGINT also exits with 0, before its end.
  config = common.load_json(os.path.join(workdir, 'config.json')) or {}
  if (process.returncode == 0 and evaluations
      and evaluations[-1]['step'] == config.get('num_train_steps')):
    record |= {'status': 'finished', 'metrics': evaluations[-1]}
  elif process.returncode == PRUNED:
    record |= {'status': 'pruned', 'metrics': evaluations[-1]}
  elif process.returncode in (0, *INTERRUPTED):
    record |= {'status': 'stopped',
               'error': 'stopped before its last step; run the sweep again '
               'to resume it'}
  else:
    with open(os.path.join(workdir, 'log.txt')) as log:
      lines = [line.strip() for line in log if line.strip()]
    record |= {'status': 'failed',
               'error': lines[-1].removeprefix('error: ') if lines else
               f'exit status {process.returncode}'}
  common.save_json(record_path, record)
  return record
