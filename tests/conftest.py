"""Test set-up: 8 simulated CPU devices, set before jax is first imported,
and one compilation cache for the session: programs compiled once (by
this process or by the training subprocesses, which inherit it) are not
compiled again.

The suite's programs are compiled with LLVM at -O1, not the CPU backend's
default: compilation is most of the suite's time, and at its small shapes
-O1 compiles about a fifth faster while the few tests that run many steps
run as fast. The tests that compare two programs bitwise hold at -O1 (at
-O0 five of them do not). XLA_FLAGS naming the level keeps its own.

For the same reason the CPU backend's loop emitters replace its MLIR
fusion emitters: most of the suite's compilations are small programs
(eager operations in the references, one per shape), and they compile in
about 30% less time with them (240 eager operations: 16.6 s to 11.8 s; a
test file of float64 references: 66 s to 45 s; the whole suite: 15% less
CPU time). XLA_FLAGS naming `xla_cpu_use_fusion_emitters` keeps its own."""

import atexit
import os
import shutil
import tempfile

_FLAGS = os.environ.get('XLA_FLAGS', '')
os.environ['XLA_FLAGS'] = ' '.join(
    [_FLAGS, '--xla_force_host_platform_device_count=8']
    + ([] if '--xla_backend_optimization_level' in _FLAGS
       else ['--xla_backend_optimization_level=1'])
    + ([] if '--xla_cpu_use_fusion_emitters' in _FLAGS
       else ['--xla_cpu_use_fusion_emitters=false'])).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix='attnlab-jax-cache-')
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_CACHE,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')

import pytest


def pytest_collection_modifyitems(items):
  """Tests marked `slow` first: a long test started near the end would
  keep one worker busy after the others have finished."""
  items.sort(key=lambda item: item.get_closest_marker('slow') is None)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory) -> str:
  """One data_dir for the whole session: each dataset is built once."""
  return str(tmp_path_factory.mktemp('data'))


@pytest.fixture(scope='session')
def stdlib_dataset(data_dir):
  from train.base.train_config import TrainConfig
  from train.data import datasets
  return datasets.load(TrainConfig(data_dir=data_dir), workdir=data_dir)


@pytest.fixture(scope='session')
def object_store():
  """A bucket on a local GCS emulator (tests/helpers/object_store.py), as
  its URL; each test writes under a prefix of its own."""
  from tests.helpers import object_store as emulator
  server = emulator.emulate()
  yield f'gs://{emulator.BUCKET}'
  server.kill()
  server.wait()
