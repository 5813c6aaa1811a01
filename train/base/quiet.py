"""Library notices that tell a person running attnlab nothing: silenced
where they are expected (tfds announcing a build or a builder config,
orbax noting that a reader's directory is read only)."""

import contextlib
import io

from absl import logging


@contextlib.contextmanager
def library_notices():
  """Within: absl log lines below ERROR, and text printed to stdout (tfds
  prints its build notices), are dropped."""
  level = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  try:
    with contextlib.redirect_stdout(io.StringIO()):
      yield
  finally:
    logging.set_verbosity(level)
