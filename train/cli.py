"""What the command lines share: their prologue and their exit statuses.

  0  done; also a training run that a signal stopped after it saved (the
     trainer says where)
  1  a training run stopped by non-finite values or a failed save
     (TrainingError)
  2  bad input: a flag, a config value, a workdir, a dataset (InputError)
Errors are one line on stderr, without a traceback.
"""

from collections.abc import Callable
import sys
from typing import Any, NoReturn

from absl import flags
from absl import logging

from train.errors import InputError, Stopped, TrainingError


def fail(message: str, status: int = 2) -> NoReturn:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(status)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing; a bad flag is one line and exit status 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    # A config file that raised is reported with its traceback inside the
    # message; its first line (the flag) and last (the error) say it all.
    lines = [line for line in str(error).splitlines() if line.strip()]
    fail(lines[0] if len(lines) == 1 else f'{lines[0]} {lines[-1].strip()}')


def outcome(work: Callable[[], Any]) -> Any:
  """work(), its errors turned into the exit statuses above."""
  try:
    return work()
  except InputError as error:
    fail(str(error))
  except TrainingError as error:
    fail(str(error), status=1)
  except Stopped:
    sys.exit(0)


def run_main(argv: list[str], work: Callable[[], Any]) -> Any:
  """The body of a command's main: no stray arguments, library logs at
  WARNING unless --verbosity is given (every checkpoint write would drown
  the progress), then `outcome(work)`."""
  if len(argv) > 1:
    fail(f'unexpected arguments: {" ".join(argv[1:])}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  return outcome(work)
