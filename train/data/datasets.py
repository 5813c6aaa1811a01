"""Datasets by name: where the examples come from and what they mean.

`load(config, workdir)` returns a `Dataset` whose splits hold examples in one
of three canonical forms, one per task (train/data/tasks.py), which
`train.data.pipeline` turns into batches:
  lm:              {'tokens': int32 [n]}, a document starting with its
                   tokenizer's end of sequence (EOS_ID but for a
                   tokenizer.json)
  seq2seq:         {'inputs': int32 [s], 'targets': int32 [t]}, each ending
                   with EOS_ID
  classification:  {'inputs': int32 [s], 'label': int}
  mqar:            {'inputs': int32 [s], 'targets': int32 [s]}, a target
                   where an answer is scored, else 0

The embedded datasets (python_stdlib_bytes, text_files, algorithmic,
listops) are built on first use into `config.data_dir`, and mqar's
examples are generated as they are read; the two text
corpora are tokenized as bytes, or by `config.tokenizer` (a Hugging Face
tokenizer.json). lm1b and translation datasets must have
been prepared there beforehand (see `not_prepared_message`).
"""

from collections.abc import Callable, Iterator
import contextlib
import dataclasses
import fcntl
import os
import time
from typing import Any

import grain
import jax
from jax.experimental import multihost_utils
import numpy as np
import tensorflow_datasets as tfds

from train.base import hosts, quiet, storage
from train.base.errors import InputError, did_you_mean
from train.base.train_config import TrainConfig
from train.data import algorithmic, builder_config, integrity, listops, mqar
from train.data import stdlib
from train.data import tasks, tokenizers


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A dataset's splits (canonical examples) and what reading them needs."""

  # What the examples pose (train/data/tasks.py), which says their form.
  task: tasks.Task
  # Split name to a MapDataset of canonical examples.
  splits: dict[str, grain.MapDataset]
  # Every token id is below this.
  vocab_size: int
  # encode(text) -> ids and decode(ids) -> text, where the data is text.
  tokenizer: Any = None
  # Classes of a classification dataset.
  num_classes: int = 0
  # Each target token is one byte, so loss in bits is bits per byte.
  byte_level: bool = False
  # LM documents are long and held in memory: shuffle their windows one by
  # one rather than whole documents.
  shuffle_windows: bool = False
  # The sha256 of the documents (train/data/stdlib.py's corpus_sha256), for
  # the corpora read from files; None for the others.
  corpus_sha256: str | None = None

  @property
  def reader_threads(self) -> int:
    """Threads that read the rows of a batch at once: none for a corpus in
    memory (they would only contend for Python's lock: grain's 16 reader
    threads made lm_stdlib's batches 8 times slower), a few for files,
    whose reads release it."""
    return 0 if self.shuffle_windows else 4


@contextlib.contextmanager
def _building_alone(data_dir: str) -> Iterator[None]:
  """Holds data_dir/.build.lock (flock): processes that would build a
  dataset at once (the trials of a sweep starting together) take turns,
  and the later ones find it built."""
  os.makedirs(data_dir, exist_ok=True)
  with open(os.path.join(data_dir, '.build.lock'), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file is closed.
    yield


def _build(make_builder: Callable[[], tfds.core.DatasetBuilder],
           data_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
  """Prepares an embedded dataset once (array_record) and opens its splits;
  returns them and the build's metadata.

  On several hosts, the first builds before the others look: with a shared
  data_dir they find it built, with a disk of their own they build their
  own copy. They look with builders made after the build, since a builder
  reads what is on disk when it is made. Damaged metadata (a
  dataset_info.json that is not JSON, or missing) is an InputError naming
  the file and how to rebuild.
  """
  problem = None
  if jax.process_index() == 0:
    try:
      with integrity.readable_metadata(data_dir):
        with quiet.library_notices():
          built = make_builder().is_prepared()
        if not built:
          with _building_alone(data_dir):
            with quiet.library_notices():
              builder = make_builder()  # Another process may have built it.
              built = builder.is_prepared()
            if not built:
              started = time.perf_counter()
              print(f'Building the dataset {builder.name} in {data_dir} '
                    '(once: later runs read it)', flush=True)
              with quiet.library_notices():
                builder.download_and_prepare()
              print(f'Built it in {time.perf_counter() - started:.0f} s.',
                    flush=True)
    except InputError as error:
      problem = str(error)
  # The others look once the first has built it; all stop if it could not.
  if not hosts.minimum_over_hosts(problem is None):
    raise InputError(problem or 'the dataset could not be built (see the '
                     "first host's output).")
  with integrity.readable_metadata(data_dir), quiet.library_notices():
    builder = make_builder()
    builder.download_and_prepare()
  rebuild = (f'Delete {builder.data_dir} and run again: it is rebuilt on '
             'first use.')
  sources = builder.as_data_source()
  if not sources:  # tfds found the files but not the metadata naming them.
    raise InputError(f'{builder.data_dir}/dataset_info.json is missing, so '
                     f'the splits there are unknown. {rebuild}')
  metadata = dict(builder.info.metadata or {})
  return integrity.checked(sources, rebuild), metadata


def _document(tokens: np.ndarray, eos_id: int = tokenizers.EOS_ID
              ) -> np.ndarray:
  """An LM document: the tokenizer's end of sequence (which starts each
  document), then the tokens."""
  return np.concatenate([[eos_id], tokens]).astype(np.int32)


def _options(config: TrainConfig) -> dict[str, Any]:
  """config.dataset_options as a dict, each key checked against those of
  config.dataset (LOADERS)."""
  known = LOADERS[config.dataset][2]
  options = dict(config.dataset_options)
  for key in options:
    if key not in known:
      raise InputError(
          f'unknown key config.dataset_options.{key} for config.dataset='
          f'{config.dataset!r}; known keys: {sorted(known) or "none"}.')
  return options


def _text_tokenizer(config: TrainConfig):
  """config.tokenizer's tokenizer (InputError naming it where it cannot be
  read), or the bytes' where it is None."""
  if config.tokenizer is None:
    return tokenizers.ByteTokenizer()
  try:
    return tokenizers.HfTokenizer(
        tokenizers.hf_tokenizer_file(config.tokenizer))
  except (OSError, ValueError) as error:
    raise InputError(str(error) if 'config.tokenizer' in str(error) else
                     f'config.tokenizer={config.tokenizer!r} cannot be read: '
                     f'{error}') from None


def _text_corpus(config: TrainConfig,
                 built: tuple[dict[str, Any], dict[str, Any]]) -> Dataset:
  """A corpus of files held in memory (about 12 MB for the standard
  library), a document each, tokenized by config.tokenizer or as bytes;
  its windows are shuffled one by one. `built`: _build's splits and
  metadata."""
  sources, metadata = built
  tokenizer = _text_tokenizer(config)
  splits = {name: grain.MapDataset.source([
      {'tokens': _document(tokenizer.encode(source[i]['text'].tobytes()),
                           tokenizer.eos_id)}
      for i in range(len(source))]) for name, source in sources.items()}
  return Dataset(tasks.LM, splits, tokenizer.vocab_size, tokenizer,
                 byte_level=config.tokenizer is None, shuffle_windows=True,
                 corpus_sha256=metadata.get('corpus_sha256'))


def load_python_stdlib_bytes(config: TrainConfig, data_dir: str,
                             workdir: str) -> Dataset:
  del workdir  # The corpus needs no tokenizer training.
  _options(config)
  return _text_corpus(config, _build(lambda: stdlib.PythonStdlibBytes(
      data_dir=data_dir, file_format='array_record'), data_dir))


def load_text_files(config: TrainConfig, data_dir: str,
                    workdir: str) -> Dataset:
  """Local text files (config.dataset_options.paths, a glob), built into
  data_dir as the standard library is."""
  del workdir
  pattern = _options(config).get('paths')
  if not isinstance(pattern, str) or not pattern:
    raise InputError(f'config.dataset_options.paths={pattern!r} must be a '
                     "glob of text files, e.g. '~/corpus/**/*.txt'.")
  files = stdlib.matched_files(pattern)
  if not files:
    raise InputError(f'config.dataset_options.paths={pattern!r} matches no '
                     "file: give a glob of text files, ** for any depth, "
                     "e.g. '~/corpus/**/*.txt'.")
  held = {split: sum(stdlib.split_of(path) == split for path in files)
          for split in ('train', 'validation')}
  if not all(held.values()):
    raise InputError(
        f'config.dataset_options.paths={pattern!r} matches {len(files)} '
        f'files, none of which falls in the '
        f'{"train" if not held["train"] else "validation"} split (a file '
        f'goes to validation by a hash of its path, '
        f'{stdlib.VALIDATION_PERCENT} in 100): give more files.')
  # Once, outside the builder (made several times): it reads every file.
  files_config = stdlib.text_files_config(pattern, files)
  return _text_corpus(config, _build(lambda: stdlib.TextFiles(
      config=files_config, data_dir=data_dir, file_format='array_record'),
      data_dir))


def _builder_config(config_cls, config: TrainConfig):
  """The builder config from config.dataset_options (its own fields only)."""
  options = _options(config)
  try:
    return builder_config.named(config_cls, **options)
  except ValueError as error:  # The config class's own check: 'key=value'.
    raise InputError(f'config.dataset_options.{error}') from None


def load_algorithmic(config: TrainConfig, data_dir: str,
                     workdir: str) -> Dataset:
  del workdir
  task_config = _builder_config(algorithmic.AlgorithmicConfig, config)
  sources, _ = _build(lambda: algorithmic.Algorithmic(
      config=task_config, data_dir=data_dir,
      file_format='array_record'), data_dir)
  splits = {name: grain.MapDataset.source(source)
            for name, source in sources.items()}
  return Dataset(tasks.SEQ2SEQ, splits, algorithmic.VOCAB_SIZE)


def load_listops(config: TrainConfig, data_dir: str,
                 workdir: str) -> Dataset:
  del workdir
  lengths_config = _builder_config(listops.ListOpsConfig, config)
  sources, _ = _build(lambda: listops.ListOps(
      config=lengths_config, data_dir=data_dir, file_format='array_record'),
      data_dir)
  splits = {name: grain.MapDataset.source(source)
            for name, source in sources.items()}
  return Dataset(tasks.CLASSIFICATION, splits, listops.VOCAB_SIZE,
                 num_classes=listops.NUM_CLASSES)


def load_mqar(config: TrainConfig, data_dir: str, workdir: str) -> Dataset:
  """Multi-query associative recall, generated from its options (nothing
  is written to data_dir)."""
  del data_dir, workdir
  options = _options(config)
  try:
    recall = mqar.MqarConfig(**options)
  except ValueError as error:  # MqarConfig's own check: 'key=value ...'.
    raise InputError(f'config.dataset_options.{error}') from None
  splits = {split: grain.MapDataset.source(mqar.Examples(recall, split))
            for split in mqar.SPLITS}
  return Dataset(tasks.MQAR, splits, recall.vocab_size)


def _how_to_prepare(name: str, data_dir: str) -> str:
  return ('prepare it on a machine with network access (TensorFlow is '
          'needed for this step only):\n'
          '  pip install tensorflow\n'
          f'  tfds build {name} --data_dir={data_dir} '
          '--file_format=array_record\n'
          'then copy that directory to config.data_dir.')


def not_prepared_message(name: str, data_dir: str) -> str:
  return (f'dataset {name!r} is not prepared in config.data_dir={data_dir!r}. '
          f'It cannot be downloaded at run time; '
          f'{_how_to_prepare(name, data_dir)}')


def _prepared_sources(name: str, data_dir: str, splits: tuple[str, ...]
                      ) -> dict[str, Any]:
  """Opens `splits` of a tfds dataset already prepared in `data_dir`."""
  try:
    with integrity.readable_metadata(data_dir):
      sources = {split: tfds.data_source(name, split=split,
                                         data_dir=data_dir, download=False)
                 for split in splits}
  except (tfds.core.registered.DatasetNotFoundError, NotImplementedError,
          FileNotFoundError, AssertionError) as error:
    raise InputError(not_prepared_message(name, data_dir)) from error
  return integrity.checked(
      sources, f'Delete it and {_how_to_prepare(name, data_dir)}')


def _text(value) -> str:
  return value.decode('utf-8') if isinstance(value, bytes) else value


def _sentencepiece(config: TrainConfig, workdir: str,
                   texts: Callable[[], Iterator[str]]
                   ) -> tokenizers.SentencePieceTokenizer:
  """The tokenizer at config.vocab_path, trained from `texts` if absent.

  The default path is inside the workdir, so a resumed run reuses it.
  """
  path = config.vocab_path or f'{workdir}/sentencepiece.model'
  # The hosts agree on whether it is there before the first writes it: one
  # that looked later would find it and not wait with the others.
  if hosts.minimum_over_hosts(storage.path(path).exists()):
    return tokenizers.SentencePieceTokenizer(path)
  if jax.process_index() == 0 and not storage.path(path).exists():
    tokenizers.train_sentencepiece(texts(), config.model.vocab_size, path)
  multihost_utils.sync_global_devices('sentencepiece')
  return tokenizers.SentencePieceTokenizer(path)


def load_lm1b(config: TrainConfig, data_dir: str,
              workdir: str) -> Dataset:
  _options(config)
  sources = _prepared_sources(config.dataset, data_dir, ('train', 'test'))
  train = sources['train']
  tokenizer = _sentencepiece(
      config, workdir,
      lambda: (_text(train[i]['text']) for i in range(len(train))))
  splits = {name: grain.MapDataset.source(source).map(
      lambda example: {'tokens': _document(
          tokenizer.encode(_text(example['text'])))})
            for name, source in sources.items()}
  return Dataset(tasks.LM, splits, tokenizer.vocab_size, tokenizer)


def load_translation(config: TrainConfig, data_dir: str,
                     workdir: str) -> Dataset:
  """A tfds translation dataset ({language: text} examples)."""
  options = _options(config)
  source_language = options.get('source_language')
  target_language = options.get('target_language')
  for key, language in options.items():
    if not isinstance(language, str) or not language:
      raise InputError(f'config.dataset_options.{key}={language!r} must be '
                       'a language code, e.g. \'en\'.')
  if len(options) != 2 or source_language == target_language:
    raise InputError(
        f'config.dataset_options.source_language={source_language!r} and '
        f'target_language={target_language!r} must be two languages.')
  sources = _prepared_sources(config.dataset, data_dir,
                              ('train', 'validation', 'test'))
  for language in (source_language, target_language):
    if language not in sources['train'][0]:
      raise InputError(
          f'config.dataset_options: language {language!r} is not in '
          f'{config.dataset!r}; it has {sorted(sources["train"][0])}.')
  train = sources['train']

  def texts():
    for i in range(len(train)):
      yield _text(train[i][source_language])
      yield _text(train[i][target_language])

  tokenizer = _sentencepiece(config, workdir, texts)
  eos = np.array([tokenizers.EOS_ID], np.int32)

  def encode(example):
    return {'inputs': np.concatenate(
                [tokenizer.encode(_text(example[source_language])), eos]),
            'targets': np.concatenate(
                [tokenizer.encode(_text(example[target_language])), eos])}

  splits = {name: grain.MapDataset.source(source).map(encode)
            for name, source in sources.items()}
  return Dataset(tasks.SEQ2SEQ, splits, tokenizer.vocab_size, tokenizer)


# Name -> (the task its examples pose, loader, the types of its options,
# config.dataset_options.KEY).
LOADERS = {
    'python_stdlib_bytes': (tasks.LM, load_python_stdlib_bytes, {}),
    'text_files': (tasks.LM, load_text_files, {'paths': str}),
    'algorithmic': (tasks.SEQ2SEQ, load_algorithmic,
                    builder_config.options_of(algorithmic.AlgorithmicConfig)),
    'listops': (tasks.CLASSIFICATION, load_listops,
                builder_config.options_of(listops.ListOpsConfig)),
    'mqar': (tasks.MQAR, load_mqar,
             builder_config.options_of(mqar.MqarConfig)),
    'lm1b': (tasks.LM, load_lm1b, {}),
    'wmt14_translate/de-en': (tasks.SEQ2SEQ, load_translation,
                              {'source_language': str,
                               'target_language': str}),
}


def option_types() -> dict[str, type]:
  """Every option of every dataset, with its type (one type an option,
  whichever datasets take it)."""
  types = {}
  for _, _, options in LOADERS.values():
    types |= options
  return types


def task_of(name: str) -> tasks.Task:
  """The task of dataset `name` (without loading it)."""
  if name not in LOADERS:
    raise InputError(f'config.dataset={name!r} must be one of '
                     f'{sorted(LOADERS)}{did_you_mean(name, LOADERS)}')
  return LOADERS[name][0]


# The corpora read from files: config.tokenizer may tokenize them, and
# they have a corpus_sha256 that config.track_corpus names.
FILE_CORPORA = ('python_stdlib_bytes', 'text_files')


def load(config: TrainConfig, workdir: str) -> Dataset:
  """The dataset `config.dataset`, built or opened in `config.data_dir`."""
  task_of(config.dataset)
  if config.tokenizer is not None and config.dataset not in FILE_CORPORA:
    raise InputError(f'config.tokenizer={config.tokenizer!r} tokenizes '
                     f'{" and ".join(FILE_CORPORA)}, not config.dataset='
                     f'{config.dataset!r} (its own tokenizer: '
                     'config.vocab_path).')
  loader = LOADERS[config.dataset][1]
  try:
    return loader(config, storage.resolve(config.data_dir), workdir)
  except OSError as error:  # A data_dir that cannot be made or written.
    raise InputError(f'config.data_dir={config.data_dir!r} cannot hold the '
                     f'dataset: {error}.') from None
