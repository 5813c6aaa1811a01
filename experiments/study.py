"""Search sweeps: workers that share one Optuna study.

A config's `get_sweep()` that returns a `configs.search.Space` runs here
(experiments/sweep.py hands it over). The study lives in a database, an
SQLite file on one machine or a database server reached from many, and
holds every trial: its values, its state and the metric it reported at each
evaluation. Each worker, started anywhere with the same --study and
--workdir, takes the next trial, runs it as its own process
(experiments/trial.py: train.train, reporting to the study) in
WORKDIR/trial-NNN/, tells the study its outcome, and repeats until the
study has its `trials`; then it waits for the trials still running
elsewhere, ready to take one over, and writes the report. The trials read
the study's URL in their environment (URL_VARIABLE), never on a command
line, and every message shows it with its password hidden (`shown`).

A worker that dies (kill -9, a lost node) stops beating: after two
--heartbeat intervals the next worker to look puts its trial back in the
queue, and whoever takes it resumes it from its checkpoint in the same
directory. A trial stopped by a signal (Ctrl-C, SIGTERM: it saves first) is
put back in the queue at once, and its worker writes the report as the
study stands.

Why Optuna: its samplers (TPE, random) and pruners (median, successive
halving) are standard, it installs from the package index, runs offline,
and keeps a study in SQLite or any SQLAlchemy database that many workers
can share (row locks on a server; on SQLite, a write lock taken as each
transaction begins: _lock_on_begin); its heartbeats find trials whose
worker died.
"""

from collections.abc import Callable
import contextlib
import json
import math
import os
import random
import re
import shlex
import signal
import threading
import time
import warnings

import numpy as np
import optuna
import sqlalchemy

from configs import search
from experiments import study_report, trials
from train import cli
from train.base.errors import InputError, TrainingError
from train.data import datasets
from train.run import metrics

# User attributes of a trial: the directory it resumes (a trial put back in
# the queue), and a trial taken beyond the budget (told failed, not run).
RESUMES, SURPLUS = 'resumes', 'surplus'
# Where a trial's process (and a sweep given no --study) reads the study's
# URL: every user of a machine sees its command lines (ps), and the URL
# may hold the database's password.
URL_VARIABLE = 'ATTNLAB_STUDY'

optuna.logging.set_verbosity(optuna.logging.WARNING)
# Heartbeats and fail_stale_trials are marked experimental.
warnings.filterwarnings('ignore',
                        category=optuna.exceptions.ExperimentalWarning)
# Optuna expects heartbeats under Study.optimize; the workers beat
# themselves, around each trial's process (_beating).
warnings.filterwarnings('ignore', message='Heartbeat of storage is supposed')


def trial_directory(trial: optuna.trial.BaseTrial) -> str:
  """trial-NNN: its own number, or that of the trial it resumes."""
  return trial.user_attrs.get(RESUMES) or f'trial-{trial.number:03d}'


def latest_attempts(study: optuna.Study
                    ) -> dict[str, optuna.trial.FrozenTrial]:
  """Each trial directory's latest attempt (a resumed trial's last one),
  trials taken beyond the budget left out."""
  return {trial_directory(trial): trial
          for trial in study.get_trials(deepcopy=False)
          if not trial.user_attrs.get(SURPLUS)}


def requeue(study: optuna.Study, trial: optuna.trial.BaseTrial) -> None:
  """Puts `trial` back in the queue: the next worker resumes it."""
  study.enqueue_trial(trial.params,
                      user_attrs={RESUMES: trial_directory(trial)})


def _lock_on_begin(engine: sqlalchemy.engine.Engine) -> None:
  """Makes each SQLite transaction take the database's write lock as it
  begins. Optuna moves a trial from one state to another by reading it,
  then writing it, in one transaction, counting on SELECT ... FOR UPDATE,
  which SQLite ignores: two workers could both take one queued trial."""
  @sqlalchemy.event.listens_for(engine, 'connect')
  def _no_implicit_transactions(connection, record):
    del record
    connection.isolation_level = None  # pysqlite's own BEGIN, deferred.

  @sqlalchemy.event.listens_for(engine, 'begin')
  def _begin_immediate(connection):
    connection.exec_driver_sql('BEGIN IMMEDIATE')
  engine.dispose()  # The connections made so far, without these.


def shown(url: str) -> str:
  """`url` as messages and reports show it: its password hidden."""
  try:
    return sqlalchemy.engine.make_url(url).render_as_string(
        hide_password=True)
  except (ValueError, sqlalchemy.exc.ArgumentError):  # Not a URL it reads.
    return re.sub(r'(://[^/@:]*:)[^/]*@', r'\1***@', url)


def storage(url: str, heartbeat: int | None = None
            ) -> optuna.storages.RDBStorage:
  """The study's database at `url`; with `heartbeat` (seconds), a trial
  whose worker has not beaten for two of them is stale and requeued."""
  kwargs = {}
  if url.startswith('sqlite:///'):
    path = url[len('sqlite:///'):]
    if os.path.dirname(path):
      os.makedirs(os.path.dirname(path), exist_ok=True)
    # Workers and their trials write at once: wait for the file's lock.
    kwargs['engine_kwargs'] = {'connect_args': {'timeout': 60}}
  for _ in range(5):
    try:
      opened = optuna.storages.RDBStorage(
          url, heartbeat_interval=heartbeat,
          heartbeat_stale_trial_callback=requeue if heartbeat else None,
          **kwargs)
      if url.startswith('sqlite:'):
        _lock_on_begin(opened.engine)
      return opened
    except sqlalchemy.exc.DBAPIError as error:
      # Workers starting together on a new database each create its
      # tables: the later ones fail, and find them made when they retry.
      failure = error
      time.sleep(0.5 + random.random())
    except (ImportError, ValueError, sqlalchemy.exc.SQLAlchemyError) as error:
      failure = error
      break
  reason = str(failure).splitlines()[0].replace(url, shown(url))
  raise InputError(f'--study={shown(url)}: cannot open it: {reason}')


def sampler(space: search.Space, seed: int) -> optuna.samplers.BaseSampler:
  """The space's sampler, seeded with `seed`."""
  if space.sampler == 'random':
    return optuna.samplers.RandomSampler(seed=seed)
  # constant_liar: running trials count as bad, so that workers drawing at
  # once do not draw the same point.
  return optuna.samplers.TPESampler(seed=seed,
                                    n_startup_trials=space.startup_trials,
                                    constant_liar=True)


# A trial reports its metric at where the evaluation stands in its own run,
# in hundredths of a percent of its num_train_steps (5000: halfway): fine
# enough that no two evaluations of a run share a point.
BUDGET_POINTS = 10_000


def budget_point(step: int, num_train_steps: int) -> int:
  """The step a trial reports its evaluation at `step` at: so the pruner
  compares trials of different lengths (shapes with the steps each trains
  in a fixed time) at the same fraction of theirs, never a long trial
  midway, its learning rate still high, with short ones' ends."""
  return round(BUDGET_POINTS * step / num_train_steps)


def reporter(trial: optuna.Trial, metric: str, num_train_steps: int):
  """The trainer's evaluation hook: reports `metric` at budget_point() of
  the trial's `num_train_steps` and answers whether the pruner stops the
  trial."""
  def on_evaluation(step: int, summary: dict[str, float]) -> bool:
    if metric not in summary:  # eval_bits_per_byte of a tokenized LM.
      raise InputError(f'--metric={metric}: the evaluation does not log it; '
                       f'it logs {", ".join(sorted(summary))}.')
    trial.report(summary[metric], budget_point(step, num_train_steps))
    return trial.should_prune()
  return on_evaluation


def pruner(space: search.Space) -> optuna.pruners.BasePruner:
  """The space's pruner, for trials that report at budget_point()."""
  first = round(BUDGET_POINTS * space.prune_after)  # Where it may first prune.
  if space.pruner == 'median':
    return optuna.pruners.MedianPruner(n_startup_trials=space.startup_trials,
                                       n_warmup_steps=first)
  if space.pruner == 'asha':
    return _AfterStartup(optuna.pruners.SuccessiveHalvingPruner(
        min_resource=first, reduction_factor=3), space.startup_trials)
  return optuna.pruners.NopPruner()


class _AfterStartup(optuna.pruners.BasePruner):
  """`pruner`'s decision, kept only once `startup` trials have finished
  (it still sees every report: successive halving records its rungs)."""

  def __init__(self, pruner: optuna.pruners.BasePruner, startup: int):
    self._pruner, self._startup = pruner, startup

  def prune(self, study: optuna.Study,
            trial: optuna.trial.FrozenTrial) -> bool:
    decision = self._pruner.prune(study, trial)
    finished = study.get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return decision and len(finished) >= self._startup


def suggest(trial: optuna.Trial, space: search.Space) -> dict:
  """The trial's value of each key (fixed ones for a resumed trial)."""
  values = {}
  for key, d in space.space.items():
    if isinstance(d, search.Choice):
      values[key] = trial.suggest_categorical(key, list(d.values))
    elif isinstance(d, search.IntRange):
      values[key] = trial.suggest_int(key, d.low, d.high, step=d.step,
                                      log=d.log)
    else:
      values[key] = trial.suggest_float(key, d.low, d.high, log=d.log)
  return values


def identity(config_arg: str, space: search.Space, common_overrides: dict,
             metric: str, mode: str) -> dict:
  """What makes two workers' sweeps the same sweep."""
  path, sep, argument = config_arg.partition(':')
  if os.path.abspath(path).startswith(trials.REPO + os.sep):
    path = os.path.relpath(os.path.abspath(path), trials.REPO)
  return {'config': path + sep + argument, 'space': space.describe(),
          'trials': space.trials, 'overrides': common_overrides,
          'metric': metric, 'mode': mode,
          'pruner': [space.pruner, space.prune_after, space.startup_trials],
          'reported_at': f'1/{BUDGET_POINTS} of num_train_steps'}


def open_study(url: str, name: str, sweep: dict,
               heartbeat: int | None = None) -> optuna.Study:
  """The study `name` at `url`, created for `sweep` (identity()) if new;
  InputError if it holds another sweep."""
  study = optuna.create_study(
      storage=storage(url, heartbeat), study_name=name, load_if_exists=True,
      direction='minimize' if sweep['mode'] == 'min' else 'maximize')
  recorded = study.user_attrs.get('sweep')
  if recorded is None:
    study.set_user_attr('sweep', sweep)
  elif json.loads(json.dumps(sweep)) != recorded:
    changed = [f'{key} {recorded.get(key)!r} -> {sweep.get(key)!r}'
               for key in sweep if recorded.get(key) != sweep.get(key)]
    raise InputError(f'--study={shown(url)} (study {name!r}) runs another '
                     f'sweep: {"; ".join(changed)}; give another '
                     '--study_name or --workdir for this one.')
  return study


def _take(study: optuna.Study, budget: int) -> optuna.Trial | None:
  """A trial to run: one put back in the queue, else a new one while the
  study has fewer than `budget`; None when there is none."""
  trials = study.get_trials(deepcopy=False)
  waiting = any(t.state == optuna.trial.TrialState.WAITING for t in trials)
  if not waiting and sum(RESUMES not in t.user_attrs
                         for t in trials) >= budget:
    return None
  trial = study.ask()
  # From its first moment: a trial without a heartbeat is never stale.
  study._storage.record_heartbeat(trial._trial_id)  # noqa: SLF001
  if RESUMES in trial.user_attrs:
    return trial
  # Workers asking at once may together pass the budget: a trial's numbers
  # are given in order, so the ones beyond it are told failed, unrun.
  new = [t.number for t in study.get_trials(deepcopy=False)
         if RESUMES not in t.user_attrs and t.number <= trial.number]
  if len(new) <= budget:
    return trial
  trial.set_user_attr(SURPLUS, True)
  study.tell(trial, state=optuna.trial.TrialState.FAIL)
  return None


@contextlib.contextmanager
def _beating(study: optuna.Study, trial: optuna.Trial, interval: int):
  """Records the trial's heartbeat every `interval` seconds meanwhile."""
  done = threading.Event()
  beat = lambda: study._storage.record_heartbeat(trial._trial_id)  # noqa
  beat()

  def loop():
    while not done.wait(interval):
      try:
        beat()
      except sqlalchemy.exc.SQLAlchemyError:
        pass  # A busy database: the next beat is in time.
  thread = threading.Thread(target=loop, daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()


class Worker:
  """Runs trials of one sweep from its study until none is left."""

  def __init__(self, *, config_arg: str, workdir: str, url: str, name: str,
               space: search.Space, sweep: dict, common_overrides: dict,
               heartbeat: int, parallel: int,
               say: Callable[[str], None]):
    self.config_arg, self.workdir, self.url, self.name = (
        config_arg, workdir, url, name)
    self.space, self.sweep, self.common_overrides = (
        space, sweep, common_overrides)
    self.heartbeat, self.parallel, self.say = heartbeat, parallel, say
    self.stop = threading.Event()  # Take no new trial.
    self.errors = []  # What stopped a thread of loop().

  def loop_until_error(self) -> None:
    """loop(), its error kept for run() and the other threads stopped."""
    try:
      self.loop()
    except Exception as error:  # pylint: disable=broad-except
      self.errors.append(error)
      self.stop.set()

  def loop(self) -> None:
    """Takes and runs trials until the study has all of its own, and none
    is running anywhere (a stale one is taken over)."""
    study = open_study(self.url, self.name, self.sweep, self.heartbeat)
    while not self.stop.is_set():
      optuna.storages.fail_stale_trials(study)  # Requeues dead workers'.
      trial = _take(study, self.space.trials)
      if trial is not None:
        self._run(study, trial)
        continue
      states = {t.state for t in study.get_trials(deepcopy=False)}
      if not states & {optuna.trial.TrialState.RUNNING,
                       optuna.trial.TrialState.WAITING}:
        return
      self.stop.wait(self.heartbeat)

  def _run(self, study: optuna.Study, trial: optuna.Trial) -> None:
    directory = trial_directory(trial)
    if self.stop.is_set():  # Taken as Ctrl-C came: left to the next worker.
      requeue(study, trial)
      study.tell(trial, state=optuna.trial.TrialState.FAIL)
      return
    with _beating(study, trial, self.heartbeat):
      # Seeded by the trial's number: its draw does not depend on which
      # worker took it (the draw happens as the values are suggested).
      study.sampler = sampler(self.space, int(np.random.SeedSequence(
          [self.space.seed, trial.number]).generate_state(1)[0]))
      values = suggest(trial, self.space)
      resumed = ' (resumed)' if RESUMES in trial.user_attrs else ''
      self.say(f'{directory}{resumed}: started, '
               + ', '.join(f'{k}={v}' for k, v in values.items()))
      try:
        record = trials.run_trial(
            self.config_arg, os.path.join(self.workdir, directory),
            self.space.overrides(values), self.common_overrides,
            self.parallel,
            module='experiments.trial',
            extra=[f'--study_name={self.name}',
                   f'--trial_id={trial._trial_id}',  # noqa: SLF001
                   f'--metric={self.sweep["metric"]}'],
            env={URL_VARIABLE: self.url})
      except Exception:  # Not left running: the worker stops (run()).
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        raise
    status, metric = record['status'], self.sweep['metric']
    value = record.get('metrics', {}).get(metric, math.nan)
    if status == 'finished' and math.isfinite(value):
      study.tell(trial, value)
      self.say(f'{directory}: finished, {metric} {value:.4g} (best '
               f'{study.best_value:.4g}, {trial_directory(study.best_trial)})')
    elif status == 'stopped':  # It saved: the next worker resumes it.
      requeue(study, trial)
      study.tell(trial, state=optuna.trial.TrialState.FAIL)
      self.say(f'{directory}: stopped, and back in the queue: the next '
               'worker resumes it.')
    elif status == 'pruned':
      study.tell(trial, state=optuna.trial.TrialState.PRUNED)
      self.say(f'{directory}: pruned at step {record["metrics"]["step"]}, '
               f'{metric} {value:.4g}')
    else:
      study.tell(trial, state=optuna.trial.TrialState.FAIL)
      self.say(f'{directory}: failed: '
               + record.get('error', f'{metric} is {value}'))


def run(config_arg: str, workdir: str, space: search.Space, *, url: str,
        name: str, metric: str, mode: str, common_overrides: dict,
        heartbeat: int = 60, parallel: int = 1) -> list[dict]:
  """Runs `parallel` workers of the sweep here until the study is done
  (or Ctrl-C, SIGTERM), then writes the report; returns its rows."""
  sweep = identity(config_arg, space, common_overrides, metric, mode)
  open_study(url, name, sweep)  # Refused here, before any worker starts.
  os.makedirs(workdir, exist_ok=True)
  # Trials run from the repository root, as `python -m ...`.
  path, sep, argument = config_arg.partition(':')
  worker = Worker(config_arg=os.path.abspath(path) + sep + argument,
                  workdir=workdir, url=url, name=name, space=space,
                  sweep=sweep, common_overrides=common_overrides,
                  heartbeat=heartbeat, parallel=parallel,
                  say=lambda line: print(line, flush=True))
  threads = [threading.Thread(target=worker.loop_until_error)
             for _ in range(parallel)]
  for thread in threads:
    thread.start()

  def wait():  # Polled: a Ctrl-C in Thread.join can leave it unjoined.
    while any(thread.is_alive() for thread in threads):
      time.sleep(0.2)
  def terminate(signum, frame):
    del signum, frame
    raise KeyboardInterrupt
  # A scheduler's SIGTERM (Slurm signals every process of the job) stops
  # the worker as Ctrl-C does.
  previous = signal.signal(signal.SIGTERM, terminate)
  try:
    wait()
  except KeyboardInterrupt:
    # The trials got the signal too: they save, stop and are requeued.
    worker.stop.set()
    wait()
    report(config_arg, workdir, space, url, name, sweep, common_overrides)
    raise
  finally:
    signal.signal(signal.SIGTERM, previous)
  if worker.errors:
    raise worker.errors[0]
  rows = report(config_arg, workdir, space, url, name, sweep,
                common_overrides)
  print(study_report.summary(rows, sweep, workdir), flush=True)
  if not any(row['status'] == 'finished' for row in rows):
    raise TrainingError(f'no trial finished; see {workdir}/leaderboard.md.')
  return rows


def report(config_arg: str, workdir: str, space: search.Space, url: str,
           name: str, sweep: dict, common_overrides: dict) -> list[dict]:
  """Writes the report of the study as it stands (study_report.write);
  returns its rows."""
  study = open_study(url, name, sweep)
  command = ['python', '-m', 'experiments.sweep', f'--config={config_arg}',
             f'--workdir={os.path.relpath(workdir)}', f'--study={shown(url)}']
  command += [f'--set={key}={value}'
              for key, value in common_overrides.items()]
  return study_report.write(
      latest_attempts(study), space, sweep, workdir, shlex.join(command),
      study_report.wall_time(study.get_trials(deepcopy=False)))


def check(config_arg: str, space: search.Space, common_overrides: dict,
          metric: str | None, mode: str | None) -> tuple[str, str]:
  """Validates the config at every bound of the space (as
  trials.check_trials does a grid's trials) and the metric; returns the
  metric and its mode: the flags', else the space's, else the task's
  quality metric. InputError naming each problem."""
  metric, mode = metric or space.metric, mode or space.mode
  chosen, chosen_mode = trials.check_trials(
      config_arg, space.corners(), common_overrides, metric, mode)
  if chosen is None:
    config = cli.load_config(config_arg, common_overrides)
    task = datasets.task_of(config.dataset)
    chosen, chosen_mode = task.quality_metric(
        metrics.final_summary(task, config.decode_splits))
  if not chosen.startswith(('eval_', 'decode_')):
    raise InputError(f'--metric={chosen}: a search ranks and prunes by a '
                     'metric of the evaluation (eval_..., decode_...).')
  return chosen, chosen_mode
