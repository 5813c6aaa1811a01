"""Search sweeps: the space, the pruner, workers sharing a study (killed
and replaced), a pruned trial, the report and the cluster launch."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import optuna
import pytest

from configs import search
from experiments import launch, study, trials
from tests.helpers import REPO
from tests.helpers.fake_trial import exiting
from tests.helpers.tiny_runs import TINY_LISTOPS
from train.base.errors import InputError

PNG = b'\x89PNG'

SEARCH_CONFIG = TINY_LISTOPS + '''

def get_sweep():
  # Seeds and logging: every trial trains the same program (see trial_env).
  return search.Space({{'seed': search.int_range(0, 10**6),
                        'logging': search.presets(
                            {{'often': {{'log_every': 25}},
                             'seldom': {{'log_every': 50}}}})}},
                      trials={trials}, sampler='random', pruner={pruner!r},
                      metric='eval_loss', mode='min')
'''


def search_config(tmp_path, data_dir, *, steps=100, eval_every=50,
                  checkpoint_every=25, trials=6, pruner='none'
                  ) -> pathlib.Path:
  path = tmp_path / 'search_config.py'
  path.write_text(SEARCH_CONFIG.format(
      data_dir=data_dir, steps=steps, log_every=50, eval_every=eval_every,
      checkpoint_every=checkpoint_every, trials=trials, pruner=pruner))
  return path


def test_a_search_space_is_checked_before_anything_runs(tmp_path, data_dir):
  for bad in (lambda: search.log_uniform(0.0, 1.0),
              lambda: search.uniform(2.0, 1.0),
              lambda: search.int_range(1.5, 3),
              lambda: search.choice(['rope']),
              lambda: search.Space({'x': search.uniform(0, 1)}, trials=0),
              lambda: search.Space({'x': [1, 2]}, trials=2),
              lambda: search.Space({'x': search.uniform(0, 1)}, trials=2,
                                   pruner='hyperband')):
    with pytest.raises(ValueError):
      bad()
  space = search.Space({'learning_rate': search.log_uniform(1e-4, 1e-2),
                        'warmup_steps': search.int_range(0, 390, step=50),
                        'model.position': search.choice(['rope', 'alibi',
                                                         'learned'])},
                       trials=4)
  first = {'learning_rate': 1e-4, 'warmup_steps': 0,
           'model.position': 'rope'}
  # Every bound of every key; the int range's top is its last step.
  assert space.corners() == [first, first | {'learning_rate': 1e-2},
                             first | {'warmup_steps': 350},
                             first | {'model.position': 'alibi'},
                             first | {'model.position': 'learned'}]
  assert space.describe()['warmup_steps'] == (
      'integer uniform in [0, 390] step 50')
  # A preset stands for the keys it sets, in trials and corners alike.
  shapes = search.presets({'narrow': {'model.d_model': 16, 'seed': 1},
                           'wide': {'model.d_model': 32}})
  space = search.Space({'shape': shapes, 'learning_rate': search.uniform(
      1e-4, 1e-3)}, trials=2)
  assert space.overrides({'shape': 'wide', 'learning_rate': 1e-4}) == {
      'model.d_model': 32, 'learning_rate': 1e-4}
  assert space.corners()[:2] == [
      {'model.d_model': 16, 'seed': 1, 'learning_rate': 1e-4},
      {'model.d_model': 32, 'learning_rate': 1e-4}]
  assert space.describe()['shape'] == (
      'presets narrow: model.d_model=16, seed=1; wide: model.d_model=32')
  with pytest.raises(ValueError, match='also draws'):
    search.Space({'shape': shapes, 'seed': search.int_range(0, 9)}, trials=2)

  config = str(search_config(tmp_path, data_dir))
  for space, metric, message in (
      (search.Space({'model.dmodel': search.int_range(16, 32)}, trials=2),
       None, "config.model has no key 'dmodel'; did you mean d_model?"),
      (search.Space({'model.num_heads': search.choice([2, 3])}, trials=2),
       None, 'model.num_heads'),
      (search.Space({'heads': search.presets({'two': {'model.num_heads': 2},
                                              'three': {'model.num_heads': 3}
                                              })}, trials=2),
       None, 'model.num_heads'),
      (search.Space({'learning_rate': search.uniform(1e-4, 1e-3)}, trials=2),
       'eval_acc', '--metric=eval_acc: no trial logs it; did you mean '
       'eval_accuracy?'),
      (search.Space({'learning_rate': search.uniform(1e-4, 1e-3)}, trials=2),
       'loss', '--metric=loss: a search ranks and prunes by a metric of '
       'the evaluation')):
    with pytest.raises(InputError, match=message):
      study.check(config, space, {}, metric, None)
  # Without a metric: the space's, else the task's quality metric.
  space = search.Space({'learning_rate': search.uniform(1e-4, 1e-3)},
                       trials=2)
  assert study.check(config, space, {}, None, None) == ('eval_accuracy',
                                                        'max')

  broken = tmp_path / 'broken.py'
  broken.write_text(pathlib.Path(config).read_text().replace(
      'int_range(0, 10**6)', 'int_range(0, 10**6, log=True)'))
  with pytest.raises(InputError, match='broken.py: get_sweep\\(\\): a log '
                     'scale needs low > 0'):
    trials.load_sweep(str(broken))


def completed(values: dict[int, float]) -> optuna.trial.FrozenTrial:
  """A finished trial that reported `values` ({budget point: value},
  study.budget_point)."""
  return optuna.trial.create_trial(
      params={}, distributions={}, value=values[max(values)],
      intermediate_values=values)


def evaluated(trial: optuna.Trial, num_train_steps: int, values: dict):
  """The pruner's answers as `trial`, a run of `num_train_steps`, reports
  `values` ({step: eval_loss}) through the trial's evaluation hook."""
  on_evaluation = study.reporter(trial, 'eval_loss', num_train_steps)
  return [on_evaluation(step, {'eval_loss': value})
          for step, value in values.items()]


@pytest.mark.core
def test_the_pruner_stops_a_trial_worse_than_the_median():
  for name in ('median', 'asha', 'none'):
    space = search.Space({'x': search.uniform(0, 1)}, trials=9, pruner=name,
                         prune_after=0.5, startup_trials=3)
    synthetic = optuna.create_study(pruner=study.pruner(space))
    for value in (1.0, 2.0, 3.0):  # As trials report: ASHA keeps rungs.
      finished = synthetic.ask()
      evaluated(finished, 30, {10: value, 20: value})
      synthetic.tell(finished, value)
    bad = synthetic.ask()
    # A third of its steps, before prune_after: not judged yet.
    assert evaluated(bad, 30, {10: 9.0, 20: 9.0}) == [
        False, name != 'none'], name
    good = synthetic.ask()
    assert evaluated(good, 30, {20: 0.5}) == [False], name
  # Fewer finished trials than startup_trials: neither prunes yet.
  for name in ('median', 'asha'):
    space = search.Space({'x': search.uniform(0, 1)}, trials=9, pruner=name)
    early = optuna.create_study(pruner=study.pruner(space))
    for value in (1.0, 2.0):
      finished = early.ask()
      evaluated(finished, 20, {10: value})
      early.tell(finished, value)
    assert evaluated(early.ask(), 20, {10: 9.0}) == [False], name


@pytest.mark.core
def test_the_pruner_compares_trials_at_the_same_fraction_of_their_steps():
  """Trials of 500 steps, evaluated at 250 and 500, and one of 1000 steps
  evaluated every 250: the long one is compared at its step 500 with the
  short ones' step 250 (half of each run), not with their final values."""
  space = search.Space({'x': search.uniform(0, 1)}, trials=9,
                       pruner='median', prune_after=0.25, startup_trials=3)
  synthetic = optuna.create_study(pruner=study.pruner(space))
  for halfway in (2.0, 2.1, 2.2):
    short = synthetic.ask()
    evaluated(short, 500, {250: halfway, 500: halfway - 0.5})
    synthetic.tell(short, halfway - 0.5)
  long = synthetic.ask()
  # At a quarter of its steps no other trial evaluated: judged by none.
  # At half, 1.9 is ahead of the short trials' 2.0 to 2.2 there, though
  # behind their final 1.5 to 1.7: it goes on.
  assert evaluated(long, 1000, {250: 3.0, 500: 1.9}) == [False, False]
  behind = synthetic.ask()
  assert evaluated(behind, 1000, {500: 2.15}) == [True]


def test_workers_asking_at_once_do_not_pass_the_budget(tmp_path):
  url = f'sqlite:///{tmp_path}/study.db'
  shared = study.open_study(url, 'budget', {'mode': 'min'})
  first = study._take(shared, budget=2)
  assert first.number == 0
  # Another worker asks between this one's count and its own ask.
  ask = shared.ask
  shared.ask = lambda: (ask(), ask())[1]
  assert study._take(shared, budget=2) is None
  surplus = shared.trials[2]
  assert surplus.state == optuna.trial.TrialState.FAIL
  assert surplus.user_attrs == {study.SURPLUS: True}
  assert sorted(study.latest_attempts(shared)) == ['trial-000', 'trial-001']
  # A trial put back in the queue is taken whatever the budget.
  study.requeue(shared, shared.trials[1])
  shared.ask = ask
  again = study._take(shared, budget=2)
  assert study.trial_directory(again) == 'trial-001'
  with pytest.raises(InputError, match='runs another sweep: mode'):
    study.open_study(url, 'budget', {'mode': 'max'})


@pytest.fixture
def trial_env() -> dict[str, str]:
  """The environment of the trials: one CPU device. The trials of these
  tests differ in their seed only: the first to run compiles the steps,
  the others read them from the session's compilation cache
  (tests/conftest.py)."""
  return {'XLA_FLAGS': ''}


def _worker(config, workdir, env) -> subprocess.Popen:
  """A worker of the study, in its own session (so that kill -9 reaches
  it alone, as when its node is lost)."""
  return subprocess.Popen(
      [sys.executable, '-m', 'experiments.sweep', f'--config={config}',
       f'--workdir={workdir}', '--heartbeat=1'], cwd=REPO,
      env=os.environ | env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _kill_the_worker_of_a_running_trial(workdir: pathlib.Path,
                                        timeout: float) -> pathlib.Path:
  """kill -9 of the worker of a trial that has saved a checkpoint and is
  still running; returns the trial's directory."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    for trial in sorted(workdir.glob('trial-*')):
      steps = [int(p.name) for p in (trial / 'checkpoints').glob('*')
               if p.name.isdigit()]
      record = trials.common.load_json(str(trial / 'trial.json')) or {}
      if (record.get('status') != 'running' or not steps
          or max(steps) >= 75):
        continue
      # The trial's lock names its process; its parent is the worker.
      pid = json.loads((trial / 'lock').read_text())['pid']
      try:
        with open(f'/proc/{pid}/stat') as f:
          worker = int(f.read().rsplit(')', 1)[1].split()[1])
      except FileNotFoundError:  # It has just ended.
        continue
      os.kill(worker, signal.SIGKILL)
      return trial
    time.sleep(0.05)
  raise AssertionError('no trial was seen running with a checkpoint')


@pytest.mark.slow
def test_two_workers_run_a_study_and_a_killed_trial_resumes(
    tmp_path, data_dir, trial_env, capsys):
  # Three trials: one per worker at first, one of them killed; then the
  # third, and the killed one resumed.
  config = search_config(tmp_path, data_dir, trials=3)
  workdir = tmp_path / 'search'
  workers = [_worker(config, workdir, trial_env),
             _worker(config, workdir, trial_env)]
  try:
    killed = _kill_the_worker_of_a_running_trial(workdir, timeout=240)
    # Takes the trial over.
    workers.append(_worker(config, workdir, trial_env))
    outputs = [worker.communicate(timeout=300)[0] for worker in workers]
  finally:
    for worker in workers:
      if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGKILL)
  assert sorted(worker.returncode for worker in workers) == [-9, 0, 0], (
      outputs)

  shared = optuna.load_study(study_name='search',
                             storage=f'sqlite:///{workdir}/study.db')
  attempts = study.latest_attempts(shared)
  assert len(attempts) == 3
  assert all(t.state == optuna.trial.TrialState.COMPLETE
             for t in attempts.values())
  # Every trial ran to its end once: the killed one failed, then resumed.
  states = [t.state.name for t in shared.trials]
  assert states.count('COMPLETE') == 3 and states.count('FAIL') == 1
  assert f'{killed.name} (resumed): started' in ''.join(outputs)
  # A worker started on the finished study runs nothing, and says so: one
  # run in this process, as experiments.sweep runs it (the workers above
  # ran its command line).
  capsys.readouterr()
  space = trials.load_sweep(str(config))
  metric, mode = study.check(str(config), space, {}, None, None)
  study.run(str(config), str(workdir), space,
            url=f'sqlite:///{workdir}/study.db', name='search',
            metric=metric, mode=mode, common_overrides={}, heartbeat=1)
  again = capsys.readouterr().out
  assert 'started' not in again
  summary = 'Search: 3 of 3 trials (3 finished); best eval_loss '
  assert any(line.startswith(summary) for line in again.splitlines()), again
  log = (killed / 'log.txt').read_text()
  resumed = int(log.split('Resumed from the checkpoint at step ')[1]
                .split('.')[0])
  assert 25 <= resumed < 100
  for trial, attempt in attempts.items():
    record = trials.common.load_json(str(workdir / trial / 'trial.json'))
    assert record['status'] == 'finished'
    assert record['metrics']['step'] == 100
    # The preset drawn set its keys.
    config = trials.common.load_json(str(workdir / trial / 'config.json'))
    assert config['log_every'] == {'often': 25, 'seldom': 50}[
        attempt.params['logging']]

  board = (workdir / 'leaderboard.md').read_text()
  assert board.count('| finished |') == 3
  best = board.split('Best (')[1].split(',')[0]
  assert f'--workdir=workdirs/{best} --config.seed=' in board
  assert '--config.log_every=' in board.split('Best (')[1]
  for name in ('params.png', 'history.png'):
    assert (workdir / name).read_bytes()[:4] == PNG


def test_a_trial_worse_than_the_median_is_pruned_and_keeps_its_checkpoint(
    tmp_path, data_dir, trial_env, monkeypatch):
  for key, value in trial_env.items():
    monkeypatch.setenv(key, value)
  config = search_config(tmp_path, data_dir, trials=4, pruner='median')
  url = f'sqlite:///{tmp_path}/study.db'
  shared = study.open_study(url, 'pruned', {'mode': 'min'})
  for value in (0.1, 0.2, 0.3):  # Far better than any tiny trial.
    shared.add_trial(completed({5000: value}))  # Halfway through theirs.
  trial = shared.ask()
  record = trials.run_trial(
      str(config), str(tmp_path / 'trial'), {'seed': 7}, {},
      module='experiments.trial',
      extra=['--study_name=pruned', f'--trial_id={trial._trial_id}',
             '--metric=eval_loss'], env={study.URL_VARIABLE: url})
  assert record['status'] == 'pruned', record
  assert record['metrics']['step'] == 50
  assert shared.trials[3].intermediate_values.keys() == {5000}
  assert (tmp_path / 'trial' / 'checkpoints' / '50').is_dir()
  assert 'Pruned at step 50' in (tmp_path / 'trial' / 'log.txt').read_text()


def test_the_cluster_launch_of_a_sweep_holds_the_study_and_the_array():
  """The workers' command has no --study: its URL is in their
  environment, from sbatch's (Slurm) or from a file (TPU VMs)."""
  command = ['python', '-m', 'experiments.sweep',
             '--config=configs/listops.py', '--workdir=/shared/ls']
  script = launch.sbatch_script(command, nodes=1, gpus_per_node=1,
                                cpus_per_task=8, partition=None,
                                time_limit='4:00:00', array=(16, 4))
  assert '#SBATCH --array=0-15%4' in script
  assert '#SBATCH --nodes=1' in script
  assert script.rstrip().endswith(
      ': "${ATTNLAB_STUDY:?the URL of the study, from the environment of '
      'sbatch (experiments/launch.py)}"\n'
      'srun .venv/bin/python -m experiments.sweep --config=configs/'
      'listops.py --workdir=/shared/ls')
  assert 'distributed' not in script
  assert launch.STUDY_VARIABLE == study.URL_VARIABLE

  tpu = launch.tpu_sweep_commands('sw', 'z', 'v5litepod-8', 'v2', True,
                                  command, workers=2,
                                  study='postgresql://db/attnlab',
                                  study_file='/tmp/study')
  archives = [c for c in tpu if 'archive' in c]
  assert len(archives) == 1  # Packed once, copied to each VM.
  assert [c[5:7] for c in tpu if '/tmp/study' in c] == [
      ['/tmp/study', 'sw-0:~/attnlab/study_url'],
      ['/tmp/study', 'sw-1:~/attnlab/study_url']]
  starts = [c[-1] for c in tpu if 'nohup' in c[-1]]
  assert [c[5] for c in tpu if 'nohup' in c[-1]] == ['sw-0', 'sw-1']
  for start in starts:
    assert start == (
        '--command=cd ~/attnlab && ATTNLAB_STUDY="$(cat study_url)" nohup '
        '.venv/bin/python -m experiments.sweep --config=configs/listops.py '
        '--workdir=/shared/ls > sweep.log 2>&1 &')
  assert all('psycopg2-binary' in c[-1] for c in tpu if 'pip' in c[-1])


SECRET = 'postgresql://alice:hunter2@127.0.0.1:9/studies'


def test_a_studys_password_is_in_no_message_nor_command_line(
    tmp_path, monkeypatch):
  """A database URL with a password: the errors that name it hide the
  password; a worker gives its trial the URL in the environment, not on
  its command line; the cluster launch takes it out of the workers'
  command (which then runs as the test above shows)."""
  for url in (SECRET, SECRET.replace('postgresql', 'mysql+pymysql'),
              SECRET.replace(':9/', ':port/')):
    with pytest.raises(InputError) as refused:
      study.storage(url)
    assert str(refused.value).startswith(
        f'--study={url.replace("hunter2", "***")}: cannot open it: ')
    assert 'hunter2' not in str(refused.value)

  started, said = [], []
  space = search.Space({'learning_rate': search.log_uniform(1e-4, 1e-2)},
                       trials=1)
  worker = study.Worker(
      config_arg='configs/listops.py', workdir=str(tmp_path), url=SECRET,
      name='secret', space=space, sweep={'metric': 'eval_loss'},
      common_overrides={}, heartbeat=60, parallel=1, say=said.append)
  shared = study.open_study(f'sqlite:///{tmp_path}/study.db', 'secret',
                            {'mode': 'min'})
  with monkeypatch.context() as patched:
    patched.setattr(trials.subprocess, 'Popen', exiting(
        1, lambda command, options: started.append((command, options))))
    worker._run(shared, shared.ask())  # pylint: disable=protected-access
  (command, options), = started
  assert options['env'][study.URL_VARIABLE] == SECRET
  shown = json.dumps([command, said, (tmp_path / 'trial-000' /
                                      'trial.json').read_text()])
  assert 'hunter2' not in shown and '--study=' not in shown

  # The launch of workers, the URL typed or in the environment.
  sweep = ['python', '-m', 'experiments.sweep', '--workdir=/shared/s']
  assert launch.study_of(sweep + [f'--study={SECRET}'], slurm=True) == (
      sweep, SECRET)
  monkeypatch.setenv(launch.STUDY_VARIABLE, SECRET)
  assert launch.study_of(sweep, slurm=False) == (sweep, SECRET)


def test_a_search_interrupted_before_any_trial_ended_writes_its_report(
    tmp_path, monkeypatch):
  """SIGTERM (as Ctrl-C) reaches the worker and its first trial, which
  saves and stops: the worker ends with KeyboardInterrupt (exit status 130
  on the command line), having written the report as the study stands: the
  trial waiting to resume, and the plots, a log-scaled key's included."""
  interrupted = []

  def stopped(*args, **kwargs):
    del args, kwargs
    if not interrupted:
      interrupted.append(True)
      signal.raise_signal(signal.SIGTERM)
      time.sleep(0.2)  # The trial saves meanwhile.
    return {'status': 'stopped', 'seconds': 1.0}

  monkeypatch.setattr(trials, 'run_trial', stopped)
  space = search.Space({'learning_rate': search.log_uniform(1e-4, 1e-2),
                        'model.position': search.choice(['rope', 'alibi'])},
                       trials=4)
  workdir = tmp_path / 'search'
  with pytest.raises(KeyboardInterrupt):
    study.run('configs/listops.py', str(workdir), space,
              url=f'sqlite:///{tmp_path}/study.db', name='search',
              metric='eval_loss', mode='min', common_overrides={})
  board = (workdir / 'leaderboard.md').read_text()
  assert '1 of 4 trials (1 waiting)' in board
  for name in ('params.png', 'history.png'):
    assert (workdir / name).read_bytes()[:4] == PNG
