"""The errors entry points report in one message, without a traceback."""

import difflib


class InputError(ValueError):
  """A wrong config value or a missing dataset; the message says which key
  or what to do. Entry points print it and exit with status 2."""


class TrainingError(RuntimeError):
  """The run stopped for a reason a person must look at (non-finite values,
  a checkpoint that could not be written); the message says what happened
  and which checkpoint is the last complete one. Entry points print it and
  exit with status 1."""


class StoreFailure(TrainingError):
  """A checkpoint could not be written to an object store: it failed, or
  did not answer within its time bound (ATTNLAB_STORE_TIMEOUT_S); the
  message says which and which checkpoint is the last complete one. Entry
  points print it and exit with status 1 at once, without waiting for the
  threads of the store's libraries, which may still be retrying."""


class Stopped(Exception):
  """A signal or preemption notice stopped the run after it saved a
  checkpoint; running it again resumes there. Entry points exit with
  status 0; `at_once`, without waiting for other threads or running exit
  handlers (as for StoreFailure)."""

  at_once = False


class Pruned(Stopped):
  """The run's evaluation hook (a sweep's pruner) stopped it after an
  evaluation and a checkpoint; experiments/trial.py exits with status 3."""


def did_you_mean(name: str, candidates) -> str:
  """'; did you mean X?' for the candidate nearest `name`, or '.' when none
  is near."""
  near = difflib.get_close_matches(str(name), [str(c) for c in candidates],
                                   n=1, cutoff=0.6)
  return f'; did you mean {near[0]}?' if near else '.'
