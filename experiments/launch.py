r"""Starts one training command on every host of a TPU pod slice or a Slurm
GPU cluster.

TPU (Cloud TPU VMs, through gcloud):

  python -m experiments.launch --tpu=NAME --zone=ZONE --accelerator=v5p-64 \
      [--create] [--dry_run] -- python -m train.train \
      --config=configs/lm1b.py --workdir=gs://BUCKET/run \
      --config.data_dir=gs://BUCKET/tensorflow_datasets

creates the slice if asked, copies this checkout's last commit (`git
archive HEAD`) to every worker and installs it with JAX for TPU, then
starts the command on all workers at once (`--worker=all`, detached, output in
~/attnlab/train.log) with `--config.distributed=True`, so that
`jax.distributed.initialize()` reads the pod from the environment. A
`gs://BUCKET/...` workdir of train.train is written there directly
(train/base/storage.py: every host its checkpoint shards, process 0 the
rest). A `gs://BUCKET/...` data_dir, which the datasets' reader cannot
open, and the workdir of any other command (a sweep's, whose tables and
trials are files of a directory) are mounted on every worker with gcsfuse
at /gcs/BUCKET (the convention of Vertex AI) and read there; the workers
then need gcsfuse, and a sweep's bucket a hierarchical namespace (orbax
completes its trials' checkpoints by renaming, which gcsfuse does only
there). Edits
not committed would not run: launch refuses, naming them, unless
--include_uncommitted copies the working tree (tracked and untracked files
that git does not ignore) instead.

GPU clusters (Slurm):

  python -m experiments.launch --slurm --nodes=4 --gpus_per_node=8 \
      [--partition=P] [--time=24:00:00] [--dry_run] -- python -m train.train ...

writes an sbatch script that starts one process per node (each seeing its
node's GPUs and --cpus_per_task cores) in this checkout, as it is on the
shared file system, and submits it; `jax.distributed.initialize()` reads the
Slurm environment. With --dry_run, both print what they would run.

Sweeps (a search's study, experiments/study.py): with --sweep, the command
after -- is a worker, `python -m experiments.sweep --config=... \
--workdir=SHARED --study=URL`, and --workers=N of it start:

  python -m experiments.launch --slurm --sweep --workers=16 --at_once=4 \
      --gpus_per_node=1 -- python -m experiments.sweep ... --study=URL

is a Slurm job array (`--array=0-15%4`), one worker per task on one node;

  python -m experiments.launch --sweep --workers=4 --tpu=NAME --zone=ZONE \
      --accelerator=v5litepod-8 [--create] -- python -m experiments.sweep ...

sets up TPU VMs NAME-0 to NAME-3 (one host each) as above and starts a
worker on each. The workers share the study's database, so the URL must
reach it from every machine: SQLite on a file system the cluster shares and
can lock, or a database server (postgresql://, mysql+pymysql://; the TPU
VMs install its Python driver, a Slurm checkout needs it in .venv); TPU VMs
take a server only. The URL (the sweep command's --study, else this
environment's ATTNLAB_STUDY) reaches the workers in their environment,
never on a command line, since it may hold the database's password: Slurm
passes it from sbatch's environment to the job's, and each TPU VM reads it
from a file only its user can read (~/attnlab/study_url, copied there).
"""

import os
import shlex
import subprocess
import tempfile

from absl import flags

from train import cli
from train.base.errors import InputError


FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHIVE = '/tmp/attnlab.tar.gz'
JAX_TPU = ('"jax[tpu]>=0.10.2,<0.11" -f '
           'https://storage.googleapis.com/jax-releases/libtpu_releases.html')
JAX_CUDA = '"jax[cuda12]>=0.10.2,<0.11"'
# The Python driver of a sweep's database server, by the study URL's scheme
# (SQLAlchemy's default ones).
DRIVERS = {'postgresql': 'psycopg2-binary', 'mysql+pymysql': 'PyMySQL'}
# Where a sweep's worker reads its study's URL when its command gives no
# --study (experiments/study.py's URL_VARIABLE, read by experiments.sweep).
STUDY_VARIABLE = 'ATTNLAB_STUDY'
# The TPU VM image of each accelerator generation (the prefix of its type).
RUNTIMES = {'v4': 'tpu-ubuntu2204-base', 'v5p': 'v2-alpha-tpuv5',
            'v5litepod': 'v2-alpha-tpuv5-lite', 'v6e': 'v2-alpha-tpuv6e'}


def distributed(train_command: list[str]) -> list[str]:
  """The command with --config.distributed=True (once)."""
  if any(arg.startswith('--config.distributed') for arg in train_command):
    return train_command
  return train_command + ['--config.distributed=True']


def mounted(train_command: list[str]) -> tuple[list[str], list[str]]:
  """The command with its gs://BUCKET/... paths that are read through a
  mount (a data_dir; the workdir of a command other than train.train) read
  at /gcs/BUCKET/..., and their buckets."""
  flags = ('--config.data_dir=',) + (
      () if 'train.train' in train_command else ('--workdir=',))
  command, buckets = [], []
  for arg in train_command:
    flag = next((flag for flag in flags
                 if arg.startswith(flag + 'gs://')), None)
    if flag:
      path = arg[len(flag + 'gs://'):]
      buckets.append(path.split('/', 1)[0])
      arg = f'{flag}/gcs/{path}'
    command.append(arg)
  return command, sorted(set(buckets))


def uncommitted() -> list[str]:
  """The files of this checkout whose edits are not committed (git status
  --porcelain: modified, added, deleted, untracked and not ignored)."""
  status = subprocess.run(['git', '-C', REPO, 'status', '--porcelain'],
                          capture_output=True, text=True, check=True).stdout
  return [line[3:] for line in status.splitlines() if line.strip()]


def archive_command(include_uncommitted: bool) -> list[str]:
  """The command that packs the checkout into ARCHIVE: its last commit,
  or the working tree's files that git does not ignore."""
  if not include_uncommitted:
    return ['git', '-C', REPO, 'archive', '--format=tar.gz',
            f'--output={ARCHIVE}', 'HEAD']
  return ['sh', '-c', f'cd {shlex.quote(REPO)} && git ls-files -z --cached '
          '--others --exclude-standard | tar --null --ignore-failed-read '
          f'-T - -czf {ARCHIVE}']


def tpu_commands(name: str, zone: str, accelerator: str, runtime: str | None,
                 create: bool, train_command: list[str],
                 include_uncommitted: bool = False, *,
                 log: str = 'train.log', packages: tuple[str, ...] = (),
                 study_file: str | None = None) -> list[list[str]]:
  """The commands, in order, that start `train_command` on every worker
  (with --config.distributed=True when it is train.train), its output in
  ~/attnlab/`log`; `study_file` (a sweep's): the file, readable by its
  user only, holding the study's URL, which the command reads in its
  environment."""
  def on_workers(script: str) -> list[str]:
    return ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', name,
            f'--zone={zone}', '--worker=all', f'--command={script}']

  commands = []
  if create:
    commands.append(['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', name,
                     f'--zone={zone}', f'--accelerator-type={accelerator}',
                     f'--version={runtime}'])
  commands.append(archive_command(include_uncommitted))
  commands.append(['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', ARCHIVE,
                   f'{name}:~/attnlab.tar.gz', f'--zone={zone}',
                   '--worker=all'])
  commands.append(on_workers(
      'rm -rf ~/attnlab && mkdir -p ~/attnlab && '
      'tar -xzf ~/attnlab.tar.gz -C ~/attnlab && cd ~/attnlab && '
      'python3 -m venv .venv && .venv/bin/pip install -q -e . '
      + ' '.join((*packages, JAX_TPU))))
  environment = ''
  if study_file:  # scp keeps its mode: the user's alone.
    commands.append(['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp',
                     study_file, f'{name}:~/attnlab/study_url',
                     f'--zone={zone}', '--worker=all'])
    environment = f'{STUDY_VARIABLE}="$(cat study_url)" '
  if 'train.train' in train_command:
    train_command = distributed(train_command)
  command, buckets = mounted(train_command)
  if buckets:
    commands.append(on_workers(' && '.join(
        f'sudo mkdir -p /gcs/{bucket} && sudo chmod a+rwx /gcs/{bucket} && '
        f'(mountpoint -q /gcs/{bucket} || gcsfuse --implicit-dirs '
        f'{bucket} /gcs/{bucket})' for bucket in buckets)))
  # Detached, so that the run outlives this ssh session; its output is in
  # ~/attnlab/train.log on each worker.
  commands.append(on_workers(
      f'cd ~/attnlab && {environment}nohup .venv/bin/{shlex.join(command)} '
      f'> {log} 2>&1 &'))
  return commands


def tpu_sweep_commands(name: str, zone: str, accelerator: str,
                       runtime: str | None, create: bool,
                       sweep_command: list[str], workers: int,
                       include_uncommitted: bool = False, *, study: str,
                       study_file: str) -> list[list[str]]:
  """The commands that start a worker of the study at URL `study` (held
  by `study_file`, its user's alone), `sweep_command` without --study, on
  each of `workers` TPU VMs, NAME-0 to NAME-<workers - 1> (one host each):
  the checkout packed once, then each VM set up and started as
  tpu_commands does."""
  commands = []
  driver = DRIVERS.get(study.split('://', 1)[0])
  for index in range(workers):
    for command in tpu_commands(f'{name}-{index}', zone, accelerator,
                                runtime, create, sweep_command,
                                include_uncommitted, log='sweep.log',
                                packages=(driver,) if driver else (),
                                study_file=study_file):
      if command not in commands:  # The archive, made once.
        commands.append(command)
  return commands


def sbatch_script(train_command: list[str], *, nodes: int,
                  gpus_per_node: int, cpus_per_task: int,
                  partition: str | None, time_limit: str,
                  array: tuple[int, int] | None = None) -> str:
  """An sbatch script: one task per node, each with its node's GPUs and
  `cpus_per_task` cores (Slurm's default, one, starves the data loader).
  With `array` (workers, at once), a sweep's: a job array of `workers`
  one-node tasks, at most `at once` running, each a worker of the study
  of `train_command` (an experiments.sweep command without --study), whose
  URL the job has in its environment from sbatch's."""
  name, output = (('attnlab-sweep', 'attnlab-sweep-%A_%a.out') if array
                  else ('attnlab', 'attnlab-%j.out'))
  lines = ['#!/bin/bash',
           f'#SBATCH --job-name={name}',
           f'#SBATCH --nodes={nodes}',
           '#SBATCH --ntasks-per-node=1',
           f'#SBATCH --gpus-per-node={gpus_per_node}',
           f'#SBATCH --cpus-per-task={cpus_per_task}',
           f'#SBATCH --time={time_limit}',
           f'#SBATCH --output={output}']
  if array:
    lines.append(f'#SBATCH --array=0-{array[0] - 1}%{array[1]}')
  if partition:
    lines.append(f'#SBATCH --partition={partition}')
  lines += ['set -euo pipefail',
            f'cd {shlex.quote(REPO)}',
            '# Once per checkout: python3 -m venv .venv && '
            f'.venv/bin/pip install -e . {JAX_CUDA}']
  if array:
    lines += ['# Each array task is one worker: it takes trials from the '
              'study until none is left, then ends,',
              '# making room for the next task, which takes over any trial '
              'whose worker was lost.',
              f': "${{{STUDY_VARIABLE}:?the URL of the study, from the '
              'environment of sbatch (experiments/launch.py)}"',
              f'srun .venv/bin/{shlex.join(train_command)}']
    return '\n'.join(lines) + '\n'
  lines += ['# One process per node; jax.distributed.initialize() reads '
            'SLURM_* for the coordinator, process count and id,',
            '# and this, for the GPUs each process drives (all its node\'s).',
            'export JAX_LOCAL_DEVICE_IDS='
            + ','.join(str(i) for i in range(gpus_per_node)),
            f'srun .venv/bin/{shlex.join(distributed(train_command))}']
  return '\n'.join(lines) + '\n'


def _python(command: list[str], sweep: bool = False) -> list[str]:
  """`python -m train.train ...` (or, for a sweep, `python -m
  experiments.sweep ...`) -> ['python', '-m', ...], checked."""
  module = 'experiments.sweep' if sweep else 'train.train'
  if not command or module not in command or '-m' not in command:
    raise InputError(f'give the {"sweep" if sweep else "training"} command '
                     f'after --, e.g. -- python -m {module} --config=... '
                     '--workdir=...' + (' --study=URL' if sweep else ''))
  return ['python'] + command[command.index('-m'):]


def study_of(sweep_command: list[str], slurm: bool) -> tuple[list[str], str]:
  """The sweep command without its --study, and the study's URL: its
  --study's, else this environment's STUDY_VARIABLE; checked for the
  workers of a Slurm job array (`slurm`) or of TPU VMs."""
  study = next((arg.split('=', 1)[1] for arg in sweep_command
                if arg.startswith('--study=')),
               os.environ.get(STUDY_VARIABLE))
  if not study:
    raise InputError('--sweep: the workers share one study: give the sweep '
                     f'command --study=URL, or set {STUDY_VARIABLE}=URL (a '
                     'database every worker reaches).')
  if not slurm and study.startswith('sqlite:'):
    raise InputError(f'--study={study}: TPU VMs share no file system that '
                     'SQLite can lock; give a database server URL '
                     '(postgresql://... or mysql+pymysql://...).')
  return [arg for arg in sweep_command
          if not arg.startswith('--study=')], study


def launch(train_command: list[str]) -> None:
  """Prints, and unless --dry_run runs, what starts `train_command`."""
  train_command = _python(train_command, FLAGS.sweep)
  study = None
  if FLAGS.sweep:
    train_command, study = study_of(train_command, FLAGS.slurm)
  if FLAGS.slurm:
    if FLAGS.sweep and FLAGS.nodes != 1:
      raise InputError('--nodes: a sweep worker runs on one node; --workers '
                       'sets how many.')
    script = sbatch_script(
        train_command, nodes=FLAGS.nodes, gpus_per_node=FLAGS.gpus_per_node,
        cpus_per_task=FLAGS.cpus_per_task, partition=FLAGS.partition,
        time_limit=FLAGS.time,
        array=((FLAGS.workers, FLAGS.at_once or FLAGS.workers)
               if FLAGS.sweep else None))
    if FLAGS.dry_run:
      print(script, end='')
      return
    with open(FLAGS.script, 'w') as f:
      f.write(script)
    subprocess.run(['sbatch', FLAGS.script], check=True,
                   env=os.environ | ({STUDY_VARIABLE: study} if study
                                     else {}))
    return
  missing = [f'--{name}' for name in ('tpu', 'zone', 'accelerator')
             if not FLAGS[name].value]
  if missing:
    raise InputError(f'{", ".join(missing)} required for a TPU launch (or '
                     'give --slurm).')
  generation = FLAGS.accelerator.rsplit('-', 1)[0]
  runtime = FLAGS.runtime or RUNTIMES.get(generation)
  if FLAGS.create and runtime is None:
    raise InputError(f'--runtime: no default for --accelerator='
                     f'{FLAGS.accelerator}; give one.')
  edits = uncommitted()
  if edits and not FLAGS.include_uncommitted:
    shown = ', '.join(edits[:5]) + (f' and {len(edits) - 5} more'
                                    if len(edits) > 5 else '')
    raise InputError(f'uncommitted edits would not run on the workers '
                     f'(git archive HEAD copies the last commit): {shown}; '
                     'commit them, or give --include_uncommitted.')
  if not FLAGS.sweep:
    _print_and_run(tpu_commands(
        FLAGS.tpu, FLAGS.zone, FLAGS.accelerator, runtime, FLAGS.create,
        train_command, FLAGS.include_uncommitted))
    return
  # Readable by this user only (mkstemp's mode), removed when launch ends.
  with tempfile.NamedTemporaryFile('w', prefix='attnlab-study-') as file:
    file.write(study)
    file.flush()
    _print_and_run(tpu_sweep_commands(
        FLAGS.tpu, FLAGS.zone, FLAGS.accelerator, runtime, FLAGS.create,
        train_command, FLAGS.workers, FLAGS.include_uncommitted,
        study=study, study_file=file.name))


def _print_and_run(commands: list[list[str]]) -> None:
  """Prints each command, and unless --dry_run runs it."""
  for command in commands:
    print(shlex.join(command), flush=True)
    if not FLAGS.dry_run:
      subprocess.run(command, check=True)


def main(argv: list[str]) -> None:
  # What follows `--` is the training command, not stray arguments.
  cli.run_main(argv[:1], lambda: launch(argv[1:]))


def _define_flags() -> None:
  """The command line, defined only when this runs as a script (so that
  the experiment modules can be imported together)."""
  flags.DEFINE_string('tpu', None, 'Name of the TPU VM (pod slice).')
  flags.DEFINE_string('zone', None, 'Zone of the TPU.')
  flags.DEFINE_string(
      'accelerator', None, 'Accelerator type, e.g. v5p-64 or v6e-256.')
  flags.DEFINE_string(
      'runtime', None, 'TPU VM software version (--version); default: the '
      "accelerator generation's (RUNTIMES).")
  flags.DEFINE_bool('create', False, 'Create the slice first.')
  flags.DEFINE_bool('slurm', False, 'Launch on Slurm instead.')
  flags.DEFINE_integer('nodes', 1, 'Slurm nodes.')
  flags.DEFINE_integer('gpus_per_node', 8, 'GPUs per node.')
  flags.DEFINE_integer('cpus_per_task', 32, 'CPU cores for the process on '
                       'each node (data loading, compilation).')
  flags.DEFINE_bool('include_uncommitted', False, 'Copy the working tree '
                    'to the TPU workers, edits not committed included, '
                    'rather than the last commit.')
  flags.DEFINE_string('partition', None, 'Slurm partition.')
  flags.DEFINE_string('time', '24:00:00', 'Slurm time limit.')
  flags.DEFINE_string('script', 'attnlab.sbatch',
                      'Where to write the sbatch script.')
  flags.DEFINE_bool('sweep', False, 'Start workers of a sweep\'s study '
                    '(the command after -- is `python -m experiments.sweep '
                    '... --study=URL`): a Slurm job array, or one TPU VM per '
                    'worker (NAME-0, NAME-1, ...).')
  flags.DEFINE_integer('workers', 1, 'Workers of a --sweep: Slurm array '
                       'tasks, or TPU VMs.', lower_bound=1)
  flags.DEFINE_integer('at_once', None, 'Slurm array tasks of a --sweep '
                       'running at once (%K); default: all.', lower_bound=1)
  flags.DEFINE_bool('dry_run', False,
                    'Print the commands instead of running them.')


if __name__ == '__main__':
  cli.run(main, _define_flags)
