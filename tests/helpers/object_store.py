"""A local Google Cloud Storage emulator (the `gcp-storage-emulator`
package, a test dependency in pyproject.toml), for the tests of runs on
`gs://`: gcsfs (etils epath's backend, so orbax's and attnlab's files),
tensorstore (orbax's arrays) and google-cloud-storage (TensorBoard's event
files) all reach it through the environment `emulate` sets, which the
training subprocesses inherit.

The emulator keeps objects in memory. `serve` makes it hold to two
things of GCS's it lacks: preconditions (ifGenerationMatch=0, create only
if absent: the workdir's lock; a deletion only of the generation read),
which it would ignore, and the header naming a download's generation,
which tensorstore needs to update an object it read (orbax's OCDBT
manifest).
"""

from http import HTTPStatus
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

BUCKET = 'attnlab-tests'


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(('localhost', 0))
    return probe.getsockname()[1]


def emulate(environ=os.environ) -> subprocess.Popen:
  """Starts the emulator with the bucket BUCKET, and points `environ`
  (this process's environment, or one for a subprocess) at it; the caller
  stops the process it returns."""
  port = _free_port()
  url = f'http://localhost:{port}'
  server = subprocess.Popen([sys.executable, __file__, str(port)],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 30
  while True:
    try:
      urllib.request.urlopen(f'{url}/storage/v1/b', timeout=1).close()
      break
    except OSError:
      if time.monotonic() > deadline or server.poll() is not None:
        server.kill()
        raise RuntimeError(f'the storage emulator did not start on {url}')
      time.sleep(0.1)
  urllib.request.urlopen(urllib.request.Request(
      f'{url}/storage/v1/b', data=json.dumps({'name': BUCKET}).encode(),
      headers={'Content-Type': 'application/json'}, method='POST')).close()
  environ.update(
      STORAGE_EMULATOR_HOST=url,  # gcsfs and google-cloud-storage.
      TENSORSTORE_GCS_HTTP_URL=url,
      # The emulator has no storage-control API for gcsfs to ask whether
      # the bucket is hierarchical.
      GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT='false')
  return server


# The preconditions a request may set (in its query, as the JSON API takes
# them), which GCS checks against the object's generation and
# metageneration; a generation of 0 means no object.
PRECONDITIONS = ('ifGenerationMatch', 'ifGenerationNotMatch',
                 'ifMetagenerationMatch', 'ifMetagenerationNotMatch')


class _Unmet(Exception):
  """A precondition the object does not meet: `status` is what GCS
  answers (412 Precondition Failed; 304 Not Modified for a read)."""

  def __init__(self, status: HTTPStatus):
    super().__init__(status.phrase)
    self.status = status


def unmet(conditions: dict[str, str], stored: dict | None) -> bool:
  """Whether an object's metadata `stored` (None: there is no object)
  fails any of a request's `conditions` ({name: value})."""
  generation = stored['generation'] if stored else '0'
  metageneration = stored['metageneration'] if stored else None
  expected = {'ifGenerationMatch': lambda value: value == generation,
              'ifGenerationNotMatch': lambda value: value != generation,
              'ifMetagenerationMatch': lambda value: value == metageneration,
              'ifMetagenerationNotMatch':
                  lambda value: value != metageneration}
  return not all(expected[name](value) for name, value in conditions.items())


def serve(port: int) -> None:
  """Runs the emulator on `port`: each download names the generation of
  what it sends (x-goog-generation), and each request's preconditions are
  checked as GCS checks them, a write's or a deletion's when it would
  change the object (412), a read's when it reads it (412, or 304 for
  ifGenerationNotMatch)."""
  from gcp_storage_emulator import exceptions
  from gcp_storage_emulator import storage as stored_objects
  from gcp_storage_emulator.handlers import objects
  # The server handles one request at a time: the request being handled.
  current = {'conditions': {}}

  def stored(storage, bucket: str, name: str) -> dict | None:
    try:
      return storage.get_file_obj(bucket, name)
    except exceptions.NotFound:
      return None

  def checked(change):
    """`change` (a Storage method that writes or deletes an object) done
    only if the object meets the request's preconditions."""
    def change_if_met(storage, bucket, name, *args, **kwargs):
      if unmet(current['conditions'], stored(storage, bucket, name)):
        raise _Unmet(HTTPStatus.PRECONDITION_FAILED)
      return change(storage, bucket, name, *args, **kwargs)
    return change_if_met

  def handled(handler, reads: bool = False):
    """`handler` with its request's preconditions in force; a read's are
    checked before it reads."""
    def handle(request, response, storage, *args, **kwargs):
      current['conditions'] = {name: request.query[name][0]
                               for name in PRECONDITIONS
                               if name in request.query}
      try:
        if reads and unmet(current['conditions'], stored(
            storage, request.params['bucket_name'],
            request.params['object_id'])):
          raise _Unmet(HTTPStatus.NOT_MODIFIED if set(current['conditions'])
                       == {'ifGenerationNotMatch'}
                       else HTTPStatus.PRECONDITION_FAILED)
        handler(request, response, storage, *args, **kwargs)
      except _Unmet as error:
        response.status = error.status
        if error.status == HTTPStatus.PRECONDITION_FAILED:
          response.json({'error': {'code': 412, 'message': (
              'At least one of the pre-conditions you specified did not '
              'hold.')}})
      finally:
        current['conditions'] = {}
    return handle

  def download_with_generation(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    found = stored(storage, request.params['bucket_name'],
                   request.params['object_id'])
    if found:
      response['x-goog-generation'] = found['generation']

  download = objects.download
  for method in ('create_file', 'delete_file'):
    setattr(stored_objects.Storage, method,
            checked(getattr(stored_objects.Storage, method)))
  objects.download = handled(download_with_generation, reads=True)
  objects.get = handled(objects.get, reads=True)
  for name in ('insert', 'upload_partial', 'xml_upload', 'delete', 'copy',
               'rewrite', 'compose'):
    setattr(objects, name, handled(getattr(objects, name)))
  # Imported once the handlers are replaced: its routes name them.
  from gcp_storage_emulator import server
  server.create_server('localhost', port, in_memory=True).run()


if __name__ == '__main__':
  serve(int(sys.argv[1]))
