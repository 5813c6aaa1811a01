"""A local Google Cloud Storage emulator (the `gcp-storage-emulator`
package, a test dependency in pyproject.toml), for the tests of runs on
`gs://`: gcsfs (etils epath's backend, so orbax's and attnlab's files),
tensorstore (orbax's arrays) and google-cloud-storage (TensorBoard's event
files) all reach it through the environment `emulate` sets, which the
training subprocesses inherit.

The emulator keeps objects in memory. It differs from GCS in two ways:
it ignores preconditions (ifGenerationMatch), and its downloads lack the
header naming the object's generation, which tensorstore needs to update
an object it read (orbax's OCDBT manifest); `serve` adds that header.
"""

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


def emulate() -> subprocess.Popen:
  """Starts the emulator with the bucket BUCKET, and points this process's
  environment at it; the caller stops the process it returns."""
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
  os.environ.update(
      STORAGE_EMULATOR_HOST=url,  # gcsfs and google-cloud-storage.
      TENSORSTORE_GCS_HTTP_URL=url,
      # The emulator has no storage-control API for gcsfs to ask whether
      # the bucket is hierarchical.
      GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT='false')
  return server


def serve(port: int) -> None:
  """Runs the emulator on `port`, each download naming the generation of
  what it sends (x-goog-generation), as GCS's do."""
  from gcp_storage_emulator import exceptions
  from gcp_storage_emulator.handlers import objects
  download = objects.download

  def download_with_generation(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    try:
      stored = storage.get_file_obj(request.params['bucket_name'],
                                    request.params['object_id'])
    except exceptions.NotFound:
      return
    response['x-goog-generation'] = stored['generation']

  objects.download = download_with_generation
  # Imported once the handler is replaced: its routes name the handlers.
  from gcp_storage_emulator import server
  server.create_server('localhost', port, in_memory=True).run()


if __name__ == '__main__':
  serve(int(sys.argv[1]))
