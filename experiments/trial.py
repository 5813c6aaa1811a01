r"""One trial of a search sweep: train.train's run, reporting its metric to
the study at every evaluation (at its fraction of the trial's steps), and
stopped there if the study's pruner says so. The sweep's workers start it
(experiments/study.py), with the study's URL in the environment
(ATTNLAB_STUDY: no command line shows its password):

  python -m experiments.trial --config=FILE --workdir=DIR \
      --study_name=NAME --trial_id=ID --metric=NAME [--config.key=value ...]

Exit status as train.train's, and 3 when the pruner stopped the trial
(after it saved its checkpoint). The trial dies with its worker
(experiments/trials.py): a worker killed at once (kill -9, a lost node)
sends it SIGTERM, and it saves and stops; the study then gives it to the
next worker, which resumes it. One process: a trial does not span hosts.
"""

import os
import sys

from absl import flags
from ml_collections import config_flags
import optuna

from experiments import study as study_lib
from experiments import trials
from train import cli
from train.base.errors import InputError, Pruned
from train.run.trainer import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Experiment config file, optionally with :argument.',
    lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, "The trial's directory.")
_STUDY_NAME = flags.DEFINE_string('study_name', None, 'Name of the study.')
_TRIAL_ID = flags.DEFINE_integer('trial_id', None,
                                 "The trial's id in the study's storage.")
_METRIC = flags.DEFINE_string('metric', None, 'Evaluation metric reported.')
flags.mark_flags_as_required(['config', 'workdir', 'study_name', 'trial_id',
                              'metric'])


def main(argv: list[str]) -> None:
  def work():
    url = os.environ.get(study_lib.URL_VARIABLE)
    if not url:
      raise InputError(f'{study_lib.URL_VARIABLE} is not set: a trial reads '
                       "its study's URL there (its worker sets it).")
    config = _CONFIG.value
    space = trials.load_sweep(
        config_flags.get_config_filename(flags.FLAGS['config']))
    study = optuna.load_study(
        study_name=_STUDY_NAME.value, storage=study_lib.storage(url),
        pruner=study_lib.pruner(space))
    trial = optuna.Trial(study, _TRIAL_ID.value)
    try:
      train_and_evaluate(
          config, _WORKDIR.value, on_evaluation=study_lib.reporter(
              trial, _METRIC.value, config.num_train_steps))
    except Pruned:
      sys.exit(trials.PRUNED)
  cli.run_main(argv, work)


if __name__ == '__main__':
  cli.run(main)
