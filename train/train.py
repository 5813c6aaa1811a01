r"""Command line: train a config, resuming from the workdir's checkpoints.

  python -m train.train --config=configs/lm_stdlib.py --workdir=DIR \
      [--config.key=value ...]

On several hosts, the same command runs on each: with --config.distributed
on a cluster JAX knows (Cloud TPU, Slurm), or with --coordinator_address,
--num_processes and --process_id elsewhere.

Exit status: 0 when trained, and also when SIGTERM, SIGINT or a preemption
notice stopped the run after saving a checkpoint (the same command
resumes); 2 with one message naming what to fix for a bad config, workdir
or dataset; 1 with one message when non-finite values or a failed save
stopped the run (docs/reliability.md).
"""

from absl import flags
from ml_collections import config_flags

from train import cli
from train.program import mesh
from train.run.trainer import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Experiment config file, optionally with :argument.',
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Directory for checkpoints, metrics and config.json.')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None,
    'host:port of process 0 of a multi-host run, where the cluster does not '
    'tell JAX itself.')
_NUM_PROCESSES = flags.DEFINE_integer(
    'num_processes', None, 'Processes of the multi-host run.')
_PROCESS_ID = flags.DEFINE_integer(
    'process_id', None, 'This process\'s index, 0 to num_processes - 1.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv: list[str]) -> None:
  def work():
    mesh.start_distributed(_CONFIG.value,
                           coordinator_address=_COORDINATOR.value,
                           num_processes=_NUM_PROCESSES.value,
                           process_id=_PROCESS_ID.value)
    train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  cli.run_main(argv, work)


def run(config, workdir: str) -> None:
  """train_and_evaluate, its outcome turned into the exit status."""
  cli.outcome(lambda: train_and_evaluate(config, workdir))


if __name__ == '__main__':
  cli.run(main)
