"""Where a run's files live: a local directory or an object store
(`gs://bucket/...`), reached through one layer, etils epath, which orbax
reads and writes its own files with (gcsfs behind `gs://`, also where
TensorFlow is installed; tensorstore writes the arrays of a checkpoint,
and tensorboardX its event files, itself).

An object store lacks three things a local disk has, and this is what
stands in for them:
- an atomic rename: there a rename copies and deletes. A file written
  whole (`write_whole`) is uploaded as one object, which appears complete
  or not at all; on a disk it is written under a temporary name and
  renamed over the old one (a name of its own, so that writers at once do
  not collide). A directory `move`d there is copied object by object
  within the store, then deleted: cut short, the source is still there,
  whole or in part.
- appending: an object cannot grow, so a file of lines (`Lines`) is
  uploaded whole when flushed; a reader never finds a line cut short. (GCS
  takes about one write of an object a second: its writer flushes less
  often than each line.)
- flock: the workdir's lock is a lease its holder renews
  (train/run/workdir.py), each write and deletion of it holding only for
  the version of it read last (`write_if`, `delete_if`).
An object store has no free-space figure either: checkpoints check the
space free on disks only. And it can stop answering (an outage, a
partition) while its libraries retry for many minutes: a run waits on it
at most ATTNLAB_STORE_TIMEOUT_S seconds at a time (`timeout_s`,
`bounded`), then fails or goes on as its caller decides. Where the run
holds the lease of a workdir (`lease`), every operation there is also
started only while the lease is known to hold, and waited for no longer
than it does; a request of this layer's own is then cancelled, so that
none lands once another run may own the workdir.

A path on an object store is a URL; a local one is made absolute (`~`
expanded), so that every host and every library reads the same place.
"""

from collections.abc import Callable
import functools
import logging
import math
import os
import sys
import tempfile
import threading
import time
from typing import TypeVar

# gcsfs behind gs:// even where TensorFlow is installed (to build tfds
# datasets): one backend, the one tested.
os.environ.setdefault('EPATH_USE_TF', 'false')

from etils import epath  # noqa: E402  (after EPATH_USE_TF)
import fsspec  # noqa: E402

# Listings read afresh each time: other processes (the other hosts, a run
# watching a lock) and other writers (tensorstore, orbax's arrays) change
# the bucket behind gcsfs's back.
fsspec.config.conf.setdefault('gcs', {})['use_listings_cache'] = False
# gcsfs logs each request that failed (out of retries, or not retried)
# with its traceback, some 50 lines: the caller says what failed, in one.
logging.getLogger('gcsfs').setLevel(logging.CRITICAL)

from train.base.errors import InputError  # noqa: E402

# The environment variable of the longest a run waits on an object store
# at a time, in seconds: an environment's setting (how long an outage of
# its store may last), which changes no result, as the libraries' own
# (STORAGE_EMULATOR_HOST, ...) are.
TIMEOUT_VARIABLE = 'ATTNLAB_STORE_TIMEOUT_S'
# Its default: twice the lease of a workdir's lock, and room for a
# checkpoint of a few GiB to be written at GCS's pace.
DEFAULT_TIMEOUT_S = 120.0
_Result = TypeVar('_Result')
# By bucket, the last operation that did not answer in time: while it
# still waits, the store is taken as not answering, and every other
# operation on it fails at once rather than wait again.
_unanswered: dict[str, threading.Thread] = {}
# By workdir (a URL), how long the lease this run holds of it is known to
# last yet, in seconds: a function that raises (LeaseLost) once it is not.
_leases: dict[str, Callable[[], float]] = {}
# The seconds left to the operation a thread of `bounded` runs, when a
# lease bounds it: its requests of this layer are cancelled then.
_operation = threading.local()


# The object stores a run may live on, by URL scheme.
SCHEMES = ('gs',)


def timeout_s() -> float:
  """ATTNLAB_STORE_TIMEOUT_S's seconds (DEFAULT_TIMEOUT_S where it is not
  set); InputError naming it unless it is a number of seconds above 0."""
  text = os.environ.get(TIMEOUT_VARIABLE)
  if text is None:
    return DEFAULT_TIMEOUT_S
  try:
    seconds = float(text)
  except ValueError:
    seconds = math.nan
  if not (math.isfinite(seconds) and seconds > 0):
    raise InputError(
        f'{TIMEOUT_VARIABLE}={text!r} is not a number of seconds above 0 '
        '(the longest a run waits on an object store at a time).')
  return seconds


def lease(workdir: str, seconds_left: Callable[[], float] | None) -> None:
  """From now on, every operation under `workdir` (a URL) in `bounded` is
  started only while `seconds_left()` says the lease this run holds of it
  lasts (it raises once it does not), and waited for no longer than that:
  a run cut off from the store past its lease writes nothing more there.
  None: no longer (the lease is released)."""
  if seconds_left is None:
    _leases.pop(resolve(workdir), None)
  else:
    _leases[resolve(workdir)] = seconds_left


def check_lease(location: str) -> float | None:
  """The seconds left of the lease of the workdir `location` lies in
  (None: no lease bounds it); what that lease raises once it has lapsed
  or been taken over."""
  location = resolve(location)
  for workdir, seconds_left in list(_leases.items()):
    if location == workdir or location.startswith(workdir + '/'):
      return seconds_left()
  return None


def _cancel_after() -> float | None:
  """The seconds a request of this layer may take: those left to the lease
  bounding the operation it serves (None: no lease bounds it)."""
  return getattr(_operation, 'seconds', None)


def bounded(work: Callable[[], _Result], location: str) -> _Result:
  """work(), operations on the store of `location`: on an object store,
  waited for up to timeout_s() seconds, then TimeoutError saying so
  (`work` goes on in the background, its libraries retrying); at once
  while an earlier operation there still waits past its time. Under a
  workdir whose lease this run holds (`lease`), started only while the
  lease is known to hold and waited for only as long as it does (what
  the lease raises then: `work`'s own requests of this layer are
  cancelled as it ends)."""
  if not is_object_store(location):
    return work()
  seconds, store = timeout_s(), bucket(location)
  unanswered = TimeoutError(f'{store} did not answer within {seconds:g} s '
                            f'({TIMEOUT_VARIABLE})')
  leased = check_lease(location)
  if store in _unanswered and _unanswered[store].is_alive():
    raise unanswered
  outcome = {}

  def run() -> None:
    _operation.seconds = leased
    try:
      outcome['result'] = work()
    except BaseException as error:  # pylint: disable=broad-except
      outcome['error'] = error

  thread = threading.Thread(target=run, daemon=True, name='store operation')
  deadline = time.monotonic() + seconds
  thread.start()
  while thread.is_alive():
    # A lease renewed meanwhile waits longer; one that lapsed raises.
    left = deadline - time.monotonic()
    if leased is not None:
      left = min(left, check_lease(location))
    thread.join(max(left, 0.0))
    if thread.is_alive() and time.monotonic() >= deadline:
      _unanswered[store] = thread
      raise unanswered
  if 'error' in outcome:
    if leased is not None:  # Cancelled as the lease ended: that is said.
      check_lease(location)
    raise outcome['error']
  return outcome['result']


def is_object_store(location: str) -> bool:
  """Whether `location` is a URL (gs://bucket/...) rather than a path."""
  return '://' in location


def unsupported(location: str) -> str | None:
  """What is wrong with a URL's scheme (None: nothing, or not a URL)."""
  scheme = location.partition('://')[0]
  if not is_object_store(location) or scheme in SCHEMES:
    return None
  return (f'{scheme}:// is not an object store a run can use; '
          f'{", ".join(f"{name}://" for name in SCHEMES)} is')


def resolve(location: str) -> str:
  """A local path made absolute (`~` expanded), a URL as given (without a
  trailing slash)."""
  if is_object_store(location):
    return location.rstrip('/')
  return os.path.abspath(os.path.expanduser(location))


def bucket(location: str) -> str:
  """The bucket of a URL: gs://bucket/run -> gs://bucket."""
  scheme, _, rest = location.partition('://')
  return f'{scheme}://{rest.split("/", 1)[0]}'


def path(location: str) -> epath.Path:
  """`location`, resolved, as a path of either kind."""
  return epath.Path(resolve(location))


def reason(error: Exception) -> str:
  """What a failed file operation says: an OSError's own words, or the
  message of an error of the store (gcsfs's are not all OSErrors)."""
  return getattr(error, 'strerror', None) or str(error)


def write_whole(file: epath.Path, data: str | bytes) -> None:
  """Writes `file` so that a reader finds the old contents or the new,
  never a part (see the module docstring); its directory is made if
  needed."""
  if is_object_store(str(file)):
    store, name = fsspec.core.url_to_fs(str(file))
    content = data.encode() if isinstance(data, str) else data
    bounded(lambda: store.pipe_file(name, content, timeout=_cancel_after()),
            str(file))
    return
  mode = 'wb' if isinstance(data, bytes) else 'w'
  file.parent.mkdir(parents=True, exist_ok=True)
  descriptor, temporary = tempfile.mkstemp(dir=file.parent,
                                           prefix=f'.{file.name}.')
  try:
    with os.fdopen(descriptor, mode) as f:
      f.write(data)
    os.replace(temporary, file)
  except BaseException:
    os.remove(temporary)
    raise


def files(directory: epath.Path) -> dict[str, int]:
  """{path relative to `directory` ('/'-separated): bytes} of every file
  under it."""
  found = {}
  for entry in directory.iterdir():
    if entry.is_dir():
      found |= {f'{entry.name}/{name}': size
                for name, size in files(entry).items()}
    else:
      found[entry.name] = entry.stat().length
  return found


def move(source: epath.Path, target: epath.Path) -> None:
  """Moves the directory `source` to `target` (a new name; its parent is
  made if needed)."""
  if not is_object_store(str(source)):
    target.parent.mkdir(parents=True, exist_ok=True)
    os.rename(source, target)
    return
  store, name = fsspec.core.url_to_fs(str(source))
  store.copy(name, fsspec.core.url_to_fs(str(target))[1], recursive=True)
  store.rm(name, recursive=True)


def _object(file: epath.Path) -> tuple[fsspec.AbstractFileSystem, str, str]:
  """(gcsfs, bucket, name in it) of a file on an object store."""
  store, name = fsspec.core.url_to_fs(str(file))
  bucket_name, key, _ = store.split_path(name)
  return store, bucket_name, key


def read_versioned(file: epath.Path) -> tuple[str, str] | None:
  """(text, generation) of `file` on an object store, read in one request
  (None: there is none). GCS numbers each version of an object it stores,
  its generation: a write, even of the same text, makes a new one."""
  store, bucket_name, key = _object(file)
  try:
    headers, contents = bounded(lambda: store.call(
        'GET', 'b/{}/o/{}', bucket_name, key, alt='media',
        timeout=_cancel_after()), str(file))
  except FileNotFoundError:
    return None
  return contents.decode(), headers['x-goog-generation']


def write_if(file: epath.Path, text: str, generation: str) -> str | None:
  """Writes `file` on an object store only if its generation is still
  `generation` ('0': only if there is none), a precondition the store
  checks (GCS's ifGenerationMatch); the generation written, or None if
  the precondition failed."""
  store, bucket_name, key = _object(file)
  # The JSON API's uploads, beside gcsfs's base (https://.../storage/v1/).
  uploads = store.base.replace('/storage/', '/upload/storage/', 1) + 'b/{}/o'
  try:
    written = bounded(lambda: store.call(
        'POST', uploads, bucket_name, uploadType='media', name=key,
        ifGenerationMatch=generation, data=text.encode(), json_out=True,
        timeout=_cancel_after()), str(file))
  except FileExistsError:  # gcsfs's word for 412 Precondition Failed.
    return None
  return written['generation']


def delete_if(file: epath.Path, generation: str) -> None:
  """Deletes `file` on an object store only if its generation is still
  `generation` (an object written since is left alone, as is none)."""
  store, bucket_name, key = _object(file)
  try:
    bounded(lambda: store.call('DELETE', 'b/{}/o/{}', bucket_name, key,
                               ifGenerationMatch=generation,
                               timeout=_cancel_after()), str(file))
  except (FileExistsError, FileNotFoundError):
    pass


# What tensorstore logs (from C++, to stderr) where it finds no credentials
# file and is not on Google Compute Engine.
NO_CREDENTIALS = 'Could not find the credentials file'


def check_credentials(location: str) -> None:
  """Has tensorstore (a checkpoint's arrays) take its credentials for the
  object store of `location` before anything else of this process asks:
  it takes them once a process. Finding none, it logs an error, though a
  store that wants none (an emulator, a public bucket) answers anyway:
  that line is dropped where the store answers, and said where not."""
  if is_object_store(location):
    _check_credentials(bucket(location))


@functools.cache
def _check_credentials(bucket_url: str) -> None:
  answered = False
  with tempfile.TemporaryFile() as captured:
    sys.stderr.flush()
    stderr = os.dup(2)
    os.dup2(captured.fileno(), 2)
    try:
      answered = _answers(bucket_url)
    finally:  # What was said meanwhile is said again, whatever happened.
      sys.stderr.flush()
      os.dup2(stderr, 2)
      os.close(stderr)
      captured.seek(0)
      said = captured.read().decode(errors='replace')
      sys.stderr.write(''.join(
          line for line in said.splitlines(keepends=True)
          if not (answered and NO_CREDENTIALS in line)))
      sys.stderr.flush()


def _answers(bucket_url: str) -> bool:
  """Whether tensorstore reads from the bucket (an object it lacks)
  within timeout_s() seconds."""
  import tensorstore  # pylint: disable=import-outside-toplevel
  deadline = time.monotonic() + timeout_s()
  left = lambda: max(deadline - time.monotonic(), 0.0)
  try:
    store = tensorstore.KvStore.open(f'{bucket_url}/').result(timeout=left())
    store.read('.attnlab-credentials-check').result(timeout=left())
  except Exception:  # pylint: disable=broad-except
    # Any error of the store's: the run's own use of it says what it is.
    return False
  return True


class Lines:
  """A text file that grows a line at a time, each line whole once
  flushed: on a disk, appended and flushed at once; on an object store,
  kept until `flush` uploads the whole object again (lines are short, and
  so are the files of them a run writes). `name` is its path."""

  def __init__(self, location: str):
    self.name = location
    self._object = (path(location) if is_object_store(location) else None)
    if self._object is None:
      self._file = open(location, 'a')
    else:
      self._text = (self._object.read_text() if self._object.exists()
                    else '')
      self._unflushed = False

  def write(self, line: str) -> None:
    """Adds `line` (ending in a newline); on a disk, OSError if it cannot
    be written."""
    if self._object is None:
      self._file.write(line)
      self._file.flush()
    else:
      self._text += line
      self._unflushed = True

  def flush(self) -> None:
    """Uploads the lines not yet uploaded, on an object store; whatever
    error the store raises if it cannot (the lines are kept)."""
    if self._object is not None and self._unflushed:
      write_whole(self._object, self._text)
      self._unflushed = False

  def close(self) -> None:
    if self._object is None:
      self._file.close()
    else:
      self.flush()
