"""Dataset files checked when opened and when read.

A truncated array_record file opens as if it held no records (reads then
return None), and a corrupted one fails in a reader thread with a message
about Riegeli chunks. Both become an InputError naming the file and how to
rebuild it: each file's record count is checked against the dataset's
metadata when the dataset is opened, and a read that fails is reported with
the file it read.
"""

import bisect
import contextlib
import glob
import json
import os
from typing import Any

from array_record.python import array_record_module
from google.protobuf import json_format
import grain

from train.base.errors import InputError


def _problem(path: str, expected: int) -> str | None:
  """What is wrong with the file at `path`, meant to hold `expected`
  records (None: nothing)."""
  if not os.path.exists(path):
    return 'is missing'
  try:
    reader = array_record_module.ArrayRecordReader(path)
    try:
      found = reader.num_records()
    finally:
      reader.close()
  except RuntimeError as error:  # A file cut short has no valid footer.
    return f'cannot be read ({str(error) or "truncated"})'
  if found != expected:
    return f'holds {found} of its {expected} records (truncated)'
  return None


class CheckedSource(grain.sources.RandomAccessDataSource):
  """A tfds array_record data source whose files were found whole, and
  whose failed reads name their file. `rebuild` says how to rebuild it."""

  def __init__(self, source: Any, rebuild: str):
    self._source, self._rebuild = source, rebuild
    splits = source.dataset_info.splits
    # Sources without file metadata (tfds.testing.mock_data's) have no file
    # to check.
    instructions = (splits[source.split].file_instructions
                    if source.split in splits else [])
    # Index of each file's first example in the split, and its path.
    self._starts, self._paths = [], []
    start = 0
    for instruction in instructions:
      problem = _problem(instruction.filename, instruction.examples_in_shard)
      if problem:
        raise InputError(f'dataset file {instruction.filename} {problem}. '
                         f'{rebuild}')
      self._starts.append(start)
      self._paths.append(instruction.filename)
      start += instruction.take

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int):
    try:
      return self._source[index]
    except RuntimeError as error:  # What the array_record reader raises.
      path = self._paths[bisect.bisect_right(self._starts, index) - 1]
      raise InputError(f'dataset file {path} is corrupted: reading example '
                       f'{index} failed ({error}). {self._rebuild}') from None


@contextlib.contextmanager
def readable_metadata(data_dir: str):
  """Turns tfds's failure to parse a dataset_info.json under `data_dir`
  into an InputError naming the file and how to rebuild it."""
  try:
    yield
  except json_format.ParseError as error:
    damaged = []
    for path in glob.glob(os.path.join(os.path.expanduser(data_dir), '**',
                                       'dataset_info.json'), recursive=True):
      try:
        with open(path) as f:
          json.load(f)
      except (OSError, ValueError):
        damaged.append(path)
    where = ', '.join(damaged) or f'a dataset_info.json in {data_dir}'
    raise InputError(
        f'{where} is damaged ({str(error).strip()[:200]}). Delete the '
        "directory holding it and run again: an embedded dataset is rebuilt "
        'on first use, a tfds one prepared again as docs/training.md says.'
        ) from None


def checked(sources: dict[str, Any], rebuild: str) -> dict[str, CheckedSource]:
  """`sources` (split name -> tfds data source), each checked."""
  return {split: CheckedSource(source, rebuild)
          for split, source in sources.items()}
