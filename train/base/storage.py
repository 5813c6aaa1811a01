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
  (train/run/workdir.py).
An object store has no free-space figure either: checkpoints check the
space free on disks only.

A path on an object store is a URL; a local one is made absolute (`~`
expanded), so that every host and every library reads the same place.
"""

import os
import tempfile

# gcsfs behind gs:// even where TensorFlow is installed (to build tfds
# datasets): one backend, the one tested.
os.environ.setdefault('EPATH_USE_TF', 'false')

from etils import epath  # noqa: E402  (after EPATH_USE_TF)
import fsspec  # noqa: E402

# Listings read afresh each time: other processes (the other hosts, a run
# watching a lock) and other writers (tensorstore, orbax's arrays) change
# the bucket behind gcsfs's back.
fsspec.config.conf.setdefault('gcs', {})['use_listings_cache'] = False


# The object stores a run may live on, by URL scheme.
SCHEMES = ('gs',)


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
  mode = 'wb' if isinstance(data, bytes) else 'w'
  if is_object_store(str(file)):
    with file.open(mode) as f:
      f.write(data)
    return
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


def create(file: epath.Path, text: str) -> bool:
  """Writes `file` on an object store unless it exists (a precondition the
  store checks: GCS's ifGenerationMatch=0); False if it does."""
  store, name = fsspec.core.url_to_fs(str(file))
  try:
    with store.open(name, 'xb') as f:
      f.write(text.encode())
  except FileExistsError:
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
