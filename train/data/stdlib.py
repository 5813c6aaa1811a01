"""`python_stdlib_bytes`: this interpreter's standard library as a byte corpus.

Every `.py` file under the standard library directory, except those inside
test folders and site-packages, in sorted order. A file goes to the
validation split when a hash of its relative path says so (5% of files), so
the split never depends on which other files exist. The builder config is
named after the Python version, whose library it holds.
"""

import hashlib
import pathlib
import sys
import sysconfig

import numpy as np
import tensorflow_datasets as tfds

EXCLUDED_DIRS = frozenset({'test', 'tests', 'idle_test', 'site-packages'})
VALIDATION_PERCENT = 5


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()['stdlib'])


def source_files(root: pathlib.Path) -> list[pathlib.Path]:
  """Relative paths of the corpus's files, sorted."""
  return sorted(
      path.relative_to(root) for path in root.rglob('*.py')
      if not EXCLUDED_DIRS & set(path.relative_to(root).parts))


def split_of(relative_path: pathlib.Path) -> str:
  digest = hashlib.sha256(relative_path.as_posix().encode()).hexdigest()
  return 'validation' if int(digest, 16) % 100 < VALIDATION_PERCENT else 'train'


class PythonStdlibBytes(tfds.core.GeneratorBasedBuilder):
  """The .py files of the running interpreter's standard library."""

  VERSION = tfds.core.Version('1.0.0')
  BUILDER_CONFIGS = [
      tfds.core.BuilderConfig(
          name=f'py{sys.version_info.major}{sys.version_info.minor}',
          description='The standard library of this Python version.')
  ]

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({
            'path': tfds.features.Text(),
            'text': tfds.features.Tensor(shape=(None,), dtype=np.uint8),
        }))

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing is downloaded.
    files = source_files(stdlib_root())
    return {split: self._generate_examples([f for f in files
                                            if split_of(f) == split])
            for split in ('train', 'validation')}

  def _generate_examples(self, relative_paths):
    root = stdlib_root()
    for relative in relative_paths:
      data = (root / relative).read_bytes()
      yield relative.as_posix(), {'path': relative.as_posix(),
                                  'text': np.frombuffer(data, np.uint8)}
