"""Where a run's files live: a local directory or an object store
(`gs://bucket/...`), reached through one layer, etils epath, which orbax
reads and writes its own files with (gcsfs behind `gs://`; tensorstore
writes the arrays of a checkpoint).

An object store lacks three things a local disk has, and this is what
stands in for them:
- an atomic rename: there a rename copies and deletes. A file written
  whole (`write_whole`) is uploaded as one object, which appears complete
  or not at all; on a disk it is written under a temporary name and
  renamed over the old one. A directory `move`d there is copied file by
  file, then deleted: cut short, the source is still there, whole or in
  part.
- appending: an object cannot grow, so a file of lines (`Lines`) is
  uploaded whole with each line; a reader never finds a line cut short.
- flock: the workdir's lock is a lease its holder renews
  (train/run/workdir.py).
An object store has no free-space figure either: checkpoints check the
space free on disks only.

A path on an object store is a URL; a local one is made absolute (`~`
expanded), so that every host and every library reads the same place.
"""

import os

from etils import epath
import fsspec

# Listings read afresh each time: other processes (the other hosts, a run
# watching a lock) and other writers (tensorstore, orbax's arrays) change
# the bucket behind gcsfs's back.
fsspec.config.conf.setdefault('gcs', {})['use_listings_cache'] = False


def is_object_store(location: str) -> bool:
  """Whether `location` is a URL (gs://bucket/...) rather than a path."""
  return '://' in location


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
  temporary = file.with_name(file.name + '.tmp')
  with temporary.open(mode) as f:
    f.write(data)
  os.replace(temporary, file)


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
  for name in files(source):  # Each copied within the store.
    (source / name).copy(target / name)
  source.rmtree()


class Lines:
  """A text file that grows a line at a time, each line whole and read
  back as soon as written: appended and flushed on a disk, the whole object
  uploaded again on an object store (lines are short, and so are the files
  of them a run writes). `name` is its path."""

  def __init__(self, location: str):
    self.name = location
    self._object = (path(location) if is_object_store(location) else None)
    if self._object is None:
      self._file = open(location, 'a')
    else:
      self._text = (self._object.read_text() if self._object.exists()
                    else '')

  def write(self, line: str) -> None:
    """Adds `line` (ending in a newline); OSError if it cannot be written."""
    if self._object is None:
      self._file.write(line)
      self._file.flush()
    else:
      write_whole(self._object, self._text + line)
      self._text += line

  def close(self) -> None:
    if self._object is None:
      self._file.close()
