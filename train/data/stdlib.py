"""Text corpora read from files, one document a file: `python_stdlib_bytes`
(this interpreter's standard library) and `text_files` (local files given
by a glob).

python_stdlib_bytes holds every `.py` file under the standard library
directory, except those inside test folders and site-packages, in sorted
order; its builder config is named after the Python version, whose library
it holds. text_files holds the files that `config.dataset_options.paths`
matches, its builder config named after their fingerprint (so files whose
bytes changed are built again, whatever their times say). In both, a file
goes to the validation split when a hash of its path (below the standard
library's root, or the glob's) says so (5% of files), so the split never
depends on which other files exist.

Each build records its corpus's fingerprint, `corpus_sha256` in its
metadata (corpus_sha256()): runs on equal fingerprints read the same
documents and are scored on the same validation split, which is what makes
the results of two machines comparable (the speedrun's track).
"""

import dataclasses
import glob
import hashlib
import itertools
import os
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


def corpus_sha256(root: pathlib.Path,
                  relative_paths: list[pathlib.Path]) -> str:
  """The sha256 of a corpus: each document's path (relative to `root`),
  length and bytes, in the order given."""
  digest = hashlib.sha256()
  for relative in relative_paths:
    data = (root / relative).read_bytes()
    digest.update(f'{relative.as_posix()}\0{len(data)}\0'.encode())
    digest.update(data)
  return digest.hexdigest()


class _Files(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A corpus of files under `_root()`, each an example {path, text bytes}."""

  def _root(self) -> pathlib.Path:
    raise NotImplementedError

  def _files(self) -> list[pathlib.Path]:
    """The files' paths relative to the root, sorted."""
    raise NotImplementedError

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=type(self).__doc__,
        features=tfds.features.FeaturesDict({
            'path': tfds.features.Text(),
            'text': tfds.features.Tensor(shape=(None,), dtype=np.uint8),
        }),
        metadata=tfds.core.MetadataDict())

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing is downloaded.
    files = self._files()
    self.info.metadata['corpus_sha256'] = corpus_sha256(self._root(), files)
    return {split: self._generate_examples([f for f in files
                                            if split_of(f) == split])
            for split in ('train', 'validation')}

  def _generate_examples(self, relative_paths):
    root = self._root()
    for relative in relative_paths:
      data = (root / relative).read_bytes()
      yield relative.as_posix(), {'path': relative.as_posix(),
                                  'text': np.frombuffer(data, np.uint8)}


class PythonStdlibBytes(_Files):
  """The .py files of the running interpreter's standard library."""

  # 1.1.0: its corpus's fingerprint in its metadata.
  VERSION = tfds.core.Version('1.1.0')
  BUILDER_CONFIGS = [
      tfds.core.BuilderConfig(
          name=f'py{sys.version_info.major}{sys.version_info.minor}',
          description='The standard library of this Python version.')
  ]

  def _root(self):
    return stdlib_root()

  def _files(self):
    return source_files(stdlib_root())


def glob_root(pattern: str) -> pathlib.Path:
  """The directory of `pattern` above its first wildcard: its files' paths
  are taken from there (a corpus moved whole keeps its splits)."""
  parts = pathlib.Path(os.path.expanduser(pattern)).parts
  fixed = [part for part in itertools.takewhile(
      lambda part: not glob.has_magic(part), parts)]
  root = pathlib.Path(*fixed) if fixed else pathlib.Path('.')
  return (root if len(fixed) < len(parts) else root.parent).resolve()


def matched_files(pattern: str) -> list[pathlib.Path]:
  """The files `pattern` (a glob, ** for any depth) matches, relative to
  its glob_root and sorted."""
  root = glob_root(pattern)
  return sorted(pathlib.Path(path).resolve().relative_to(root)
                for path in glob.glob(os.path.expanduser(pattern),
                                      recursive=True)
                if os.path.isfile(path))


@dataclasses.dataclass
class TextFilesConfig(tfds.core.BuilderConfig):
  """The glob of the files."""

  paths: str = ''


def text_files_config(pattern: str,
                      files: list[pathlib.Path]) -> TextFilesConfig:
  """The config of `files`, those `pattern` matches (matched_files), named
  after their corpus_sha256: a build is found again exactly when the files
  hold the same bytes (a time restored after an edit hides nothing)."""
  digest = corpus_sha256(glob_root(pattern), files)
  return TextFilesConfig(name=f'files-{digest[:16]}', paths=pattern)


class TextFiles(_Files):
  """Local text files given by a glob, one document each."""

  VERSION = tfds.core.Version('1.1.0')
  BUILDER_CONFIG_CLS = TextFilesConfig

  def _root(self):
    return glob_root(self.builder_config.paths)

  def _files(self):
    return matched_files(self.builder_config.paths)
