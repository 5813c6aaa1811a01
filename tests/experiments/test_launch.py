"""experiments/launch.py: commands for TPU pods and Slurm clusters."""

import subprocess
import sys

from experiments import launch
from tests.helpers import REPO


TRAIN = ['python', '-m', 'train.train', '--config=configs/lm1b.py',
         '--config.data_dir=gs://bucket/tfds', '--workdir=gs://bucket/run']


def test_tpu_launch_commands_run_on_every_worker():
  commands = launch.tpu_commands('pod', 'us-east5-a', 'v5p-64',
                                 'v2-alpha-tpuv5', True, TRAIN)
  create, archive, copy, install, mount, start = commands
  assert create[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create',
                        'pod']
  assert '--accelerator-type=v5p-64' in create
  assert archive[3:5] == ['archive', '--format=tar.gz']
  assert copy[4] == 'scp' and '--worker=all' in copy
  for command in (install, mount, start):
    assert command[4:6] == ['ssh', 'pod'] and '--worker=all' in command
  assert 'jax[tpu]' in install[-1]
  assert 'gcsfuse --implicit-dirs bucket /gcs/bucket' in mount[-1]
  assert start[-1].endswith(
      'nohup .venv/bin/python -m train.train --config=configs/lm1b.py '
      '--config.data_dir=/gcs/bucket/tfds --workdir=gs://bucket/run '
      '--config.distributed=True '
      '> train.log 2>&1 &')


def test_buckets_are_mounted_for_data_and_for_commands_other_than_training():
  """train.train writes a gs:// workdir itself; a sweep's workdir, and any
  data_dir, are read through gcsfuse."""
  sweep = ['python', '-m', 'experiments.sweep', '--workdir=gs://b/ls',
           '--config.data_dir=gs://c/tfds']
  assert launch.mounted(sweep) == (
      sweep[:3] + ['--workdir=/gcs/b/ls', '--config.data_dir=/gcs/c/tfds'],
      ['b', 'c'])
  assert launch.mounted(TRAIN) == (
      TRAIN[:4] + ['--config.data_dir=/gcs/bucket/tfds', TRAIN[-1]],
      ['bucket'])


def test_launch_dry_run_prints_commands_and_slurm_script():
  run = lambda *args: subprocess.run(
      [sys.executable, '-m', 'experiments.launch', *args, '--dry_run', '--',
       *TRAIN[:-2], '--workdir=/shared/run'], cwd=REPO, capture_output=True,
      text=True, check=True).stdout
  # The working tree, which the suite's own runs may add files to.
  tpu = run('--tpu=pod', '--zone=z', '--accelerator=v6e-64',
            '--include_uncommitted').splitlines()
  assert len(tpu) == 4  # Archive, copy, install, start: no create.
  assert 'git ls-files -z --cached --others --exclude-standard' in tpu[0]
  assert '--worker=all' in tpu[-1]
  script = run('--slurm', '--nodes=4', '--gpus_per_node=8',
               '--cpus_per_task=48')
  assert '#SBATCH --nodes=4' in script
  assert '#SBATCH --ntasks-per-node=1' in script
  assert '#SBATCH --cpus-per-task=48' in script
  assert 'export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7' in script
  assert script.rstrip().endswith(
      'srun .venv/bin/python -m train.train --config=configs/lm1b.py '
      '--workdir=/shared/run --config.distributed=True')
