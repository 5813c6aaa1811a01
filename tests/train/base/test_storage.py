"""One file layer for a disk and an object store: files written whole,
files of lines, and the sizes of a directory's files, the same on both
(the object store a local GCS emulator)."""

import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import REPO
from train.base import storage


@pytest.fixture(params=['disk', 'object store'])
def directory(request, tmp_path):
  if request.param == 'disk':
    return str(tmp_path)
  return f'{request.getfixturevalue("object_store")}/{tmp_path.name}'


def test_files_are_written_whole_and_lines_read_back_once_flushed(
    directory):
  root = storage.path(directory)
  root.mkdir(parents=True, exist_ok=True)
  storage.write_whole(root / 'a.json', '{"old": 1}')
  storage.write_whole(root / 'a.json', '{"new": 2}')
  storage.write_whole(root / 'sub' / 'b.bin', b'\x00\x01\x02')
  assert (root / 'a.json').read_text() == '{"new": 2}'
  assert storage.files(root) == {'a.json': 10, 'sub/b.bin': 3}

  lines = storage.Lines(f'{directory}/m.jsonl')
  lines.write('1\n')
  lines.flush()
  assert (root / 'm.jsonl').read_text() == '1\n'
  lines.write('2\n')
  lines.close()
  again = storage.Lines(f'{directory}/m.jsonl')  # A resumed run's.
  again.write('3\n')
  again.close()
  assert (root / 'm.jsonl').read_text() == '1\n2\n3\n'

  storage.move(root / 'sub', root / 'moved' / 'sub')
  assert storage.files(root / 'moved') == {'sub/b.bin': 3}
  assert not (root / 'sub').exists()


def test_local_paths_are_made_absolute_and_urls_kept():
  assert storage.resolve('~/x') == storage.resolve('~') + '/x'
  assert storage.resolve('gs://bucket/run/') == 'gs://bucket/run'
  assert storage.bucket('gs://bucket/run/a') == 'gs://bucket'


def test_a_failure_is_said_in_the_errors_own_words():
  assert storage.reason(OSError(28, 'No space left on device')) == (
      'No space left on device')
  assert storage.reason(ValueError('429 rate limit')) == '429 rate limit'
  assert storage.is_object_store('gs://bucket/run')
  assert not storage.is_object_store('/tmp/run')


def test_tensorstores_missing_credentials_are_said_where_the_store_fails(
    object_store, tmp_path):
  """tensorstore, finding no credentials (none in gcloud's folder, not on
  GCE), logs an error once a process: dropped where the store answers
  (the emulator wants none), said where it does not (nothing listens)."""
  with socket.socket() as probe:  # A port nothing listens on, once closed.
    probe.bind(('localhost', 0))
    closed = f'localhost:{probe.getsockname()[1]}'
  environ = os.environ | {'CLOUDSDK_CONFIG': str(tmp_path),
                          'GCE_METADATA_ROOT': closed}
  environ.pop('GOOGLE_APPLICATION_CREDENTIALS', None)

  def said(**changes) -> str:
    return subprocess.run(
        [sys.executable, '-c', 'from train.base import storage; '
         f'storage.check_credentials("{object_store}/run")'],
        cwd=REPO, env=environ | changes, capture_output=True, text=True,
        timeout=120, check=True).stderr

  assert storage.NO_CREDENTIALS not in said()
  assert storage.NO_CREDENTIALS in said(
      TENSORSTORE_GCS_HTTP_URL=f'http://{closed}',
      ATTNLAB_STORE_TIMEOUT_S='1')
