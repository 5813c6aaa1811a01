"""Runs command lines in this one process, as `python -m MODULE ARGS`
would (each module's `__main__` block), and prints, as JSON, each one's
exit status and what it wrote to the stdout and stderr file descriptors.

  python tests/helpers/cli_cases.py '[["train.train", ["--config=..."]], ...]'

A MODULE ending in .py is run as that file. One process imports JAX and
the tools once for all the cases; the flags each case defines are removed
after it.
"""

import contextlib
import json
import os
import runpy
import sys
import tempfile
import traceback

from absl import app
from absl import flags

# The repository's root, two folders up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


@contextlib.contextmanager
def _captured(fd: int, stream):
  """What is written to file descriptor `fd` (and `stream`), as text."""
  text = []
  with tempfile.TemporaryFile() as capture:
    stream.flush()
    saved = os.dup(fd)
    os.dup2(capture.fileno(), fd)
    try:
      yield text
    finally:
      stream.flush()
      os.dup2(saved, fd)
      os.close(saved)
      capture.seek(0)
      text.append(capture.read().decode(errors='replace'))


def run(target: str, args: list[str], base: set[str]) -> dict:
  sys.argv = [target, *args]
  status = 0
  with _captured(1, sys.stdout) as out, _captured(2, sys.stderr) as err:
    try:
      if target.endswith('.py'):
        runpy.run_path(target, run_name='__main__')
      else:  # As a fresh module, like `python -m`.
        sys.modules.pop(target, None)
        runpy.run_module(target, run_name='__main__', alter_sys=True)
    except SystemExit as stop:
      status = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
      status = 'raised'
    finally:
      for name in set(flags.FLAGS) - base:
        if name in flags.FLAGS:
          delattr(flags.FLAGS, name)
      flags.FLAGS.unparse_flags()
  return {'status': status, 'stdout': out[0], 'stderr': err[0]}


if __name__ == '__main__':
  cases = json.loads(sys.argv[1])
  app.define_help_flags()  # Defined once, by the first app.run: kept.
  base = set(flags.FLAGS)
  print(json.dumps([run(target, args, base) for target, args in cases]))
