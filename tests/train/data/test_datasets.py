"""Datasets, tokenizers and the batch pipeline."""

import concurrent.futures
import os
import pathlib
import random
import re
import time
import types

import grain
import numpy as np
import pytest

from configs import default
from tests.helpers import REPO
from train import cli
from train.base.errors import InputError
from train.base.train_config import TrainConfig
from train.config import validation as config_validation
from train.data import algorithmic, builder_config, datasets, layouts, listops
from train.data import pipeline, stdlib, tasks, tokenizers


# --- Tokenizers ---


@pytest.mark.core
def test_byte_tokenizer_round_trips_unicode():
  tokenizer = tokenizers.ByteTokenizer()
  text = 'def f(x):\n    return "héllo ✓"\n'
  ids = tokenizer.encode(text)
  assert ids.min() >= 2 and ids.max() < tokenizer.vocab_size
  assert len(ids) == len(text.encode('utf-8'))
  assert tokenizer.decode(ids) == text
  assert tokenizer.decode(np.concatenate([[1], ids, [0, 0]])) == text


def test_sentencepiece_trains_locally_and_round_trips(tmp_path):
  rng = random.Random(0)
  words = ['the', 'cat', 'sat', 'on', 'mat', 'dog', 'ran', 'far', 'away']
  texts = [' '.join(rng.choice(words) for _ in range(12)) for _ in range(300)]
  path = str(tmp_path / 'spm' / 'model')
  tokenizer = tokenizers.train_sentencepiece(texts, 40, path)
  assert pathlib.Path(path).exists()
  assert 3 < tokenizer.vocab_size <= 40
  for text in texts[:20] + ['the dog ran far away']:
    ids = tokenizer.encode(text)
    assert ids.min() > tokenizers.EOS_ID
    assert tokenizer.decode(ids) == text
  reloaded = tokenizers.SentencePieceTokenizer(path)
  assert list(reloaded.encode(texts[0])) == list(tokenizer.encode(texts[0]))


# --- python_stdlib_bytes ---


def test_stdlib_corpus_excludes_tests_and_site_packages():
  files = stdlib.source_files(stdlib.stdlib_root())
  assert files == sorted(files) and len(files) > 100
  assert pathlib.Path('json/decoder.py') in files
  for path in files:
    assert not {'test', 'tests', 'site-packages'} & set(path.parts)


def test_stdlib_split_is_a_stable_hash_of_the_path():
  files = stdlib.source_files(stdlib.stdlib_root())
  splits = [stdlib.split_of(path) for path in files]
  assert splits == [stdlib.split_of(path) for path in files]
  assert 0.02 < splits.count('validation') / len(files) < 0.10


def test_stdlib_documents_hold_every_byte_of_the_corpus_once(stdlib_dataset):
  root = stdlib.stdlib_root()
  assert stdlib_dataset.corpus_sha256 == stdlib.corpus_sha256(
      root, stdlib.source_files(root))
  corpus_bytes = sum((root / path).stat().st_size
                     for path in stdlib.source_files(root))
  assert stdlib_dataset.task is tasks.LM and stdlib_dataset.byte_level
  # Each document is EOS_ID, then its bytes.
  documents = [split[i]['tokens'] for split in stdlib_dataset.splits.values()
               for i in range(len(split))]
  assert all(d[0] == tokenizers.EOS_ID for d in documents)
  assert sum(len(d) - 1 for d in documents) == corpus_bytes
  windows = layouts.in_memory_windows(stdlib_dataset.splits['validation'],
                                       seq_len=256)
  assert sum(len(windows[i]['tokens']) - 1 for i in range(len(windows))) == (
      sum(len(split[i]['tokens']) - 1
          for split in (stdlib_dataset.splits['validation'],)
          for i in range(len(split))))


def _text_files(corpus: pathlib.Path, data_dir: pathlib.Path):
  return datasets.load(TrainConfig(
      dataset='text_files', dataset_options={'paths': f'{corpus}/*.txt'},
      data_dir=str(data_dir)), workdir=str(data_dir))


def test_a_corpus_fingerprint_is_stable_and_changes_with_a_document(
    tmp_path):
  """Two builds of the same files agree (the track is frozen by it); a
  changed byte of one document changes it."""
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  for i in range(40):  # Enough files for both splits.
    (corpus / f'{i:02d}.txt').write_text(f'document {i}\n' * 3)
  first = _text_files(corpus, tmp_path / 'a').corpus_sha256
  assert first == _text_files(corpus, tmp_path / 'b').corpus_sha256
  assert len(first) == 64 and first == stdlib.corpus_sha256(
      corpus, stdlib.matched_files(f'{corpus}/*.txt'))
  (corpus / '07.txt').write_text('document 7\n' * 2 + 'document 8\n')
  assert _text_files(corpus, tmp_path / 'a').corpus_sha256 != first


def test_the_default_config_holds_every_dataset_option_unset():
  """Each option of each dataset, of one type whichever datasets take it,
  so that any of them typed as a flag parses."""
  options = default.get_config().dataset_options
  types = {}
  for _, _, declared in datasets.LOADERS.values():
    for option, kind in declared.items():
      assert kind in (int, float, str, bool), (option, kind)
      assert types.setdefault(option, kind) == kind, option
  assert set(options) == set(types) == {'paths', 'task', 'num_train',
                                        'num_eval', 'max_length',
                                        'long_max_length', 'seed',
                                        'min_length', 'max_depth', 'max_args',
                                        'source_language', 'target_language',
                                        'vocab_size', 'num_pairs', 'length',
                                        'power_a', 'random_fillers'}
  assert all(options[option] is None for option in options)


def test_the_documented_text_files_flag_sets_the_glob_of_the_corpus(
    tmp_path, monkeypatch):
  """docs/training.md's `--config.dataset_options.paths='~/corpus/**/*.txt'`
  (the shell takes the quotes) on make train's config: it parses,
  validates and loads the files it names."""
  documented = re.search(r"`--config\.dataset_options\.paths='([^']+)'`",
                         (REPO / 'docs' / 'training.md').read_text())
  pattern = documented.group(1)
  monkeypatch.setenv('HOME', str(tmp_path))
  for i in range(40):
    path = tmp_path / 'corpus' / f'part{i % 3}' / f'{i:02d}.txt'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'document {i}\n')
  config = cli.load_config('configs/lm_stdlib.py', {
      'dataset': 'text_files', 'dataset_options.paths': pattern,
      'data_dir': str(tmp_path / 'data')})
  checked = config_validation.validate(config)
  assert checked.dataset_options == {'paths': pattern}
  assert datasets.load(checked, str(tmp_path)).corpus_sha256 == (
      stdlib.corpus_sha256(tmp_path / 'corpus',
                           sorted(pathlib.Path(f'part{i % 3}', f'{i:02d}.txt')
                                  for i in range(40))))


def test_a_glob_that_matches_no_file_is_refused_saying_so(tmp_path):
  (tmp_path / 'corpus' / 'empty.txt').mkdir(parents=True)  # Not a file.
  pattern = f'{tmp_path}/corpus/*.txt'
  with pytest.raises(InputError) as error:
    _text_files(tmp_path / 'corpus', tmp_path / 'data')
  assert str(error.value).startswith(
      f'config.dataset_options.paths={pattern!r} matches no file')


def test_an_edit_in_place_with_its_time_restored_is_built_again(
    tmp_path, capsys):
  """Same size, same modification time, other bytes: the corpus is built
  again and its fingerprint is that of the bytes now in the files."""
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  for i in range(40):
    (corpus / f'{i:02d}.txt').write_text(f'document {i}\n')
  first = _text_files(corpus, tmp_path / 'data')
  edited = corpus / '07.txt'
  times = edited.stat()
  edited.write_text('Document 7\n')
  os.utime(edited, ns=(times.st_atime_ns, times.st_mtime_ns))
  assert edited.stat().st_mtime_ns == times.st_mtime_ns
  capsys.readouterr()
  second = _text_files(corpus, tmp_path / 'data')
  assert 'Building the dataset' in capsys.readouterr().out
  assert second.corpus_sha256 != first.corpus_sha256
  assert second.corpus_sha256 == stdlib.corpus_sha256(
      corpus, stdlib.matched_files(f'{corpus}/*.txt'))
  documents = {second.tokenizer.decode(split[i]['tokens'])
               for split in second.splits.values() for i in range(len(split))}
  assert 'Document 7\n' in documents and 'document 7\n' not in documents


# --- algorithmic ---


def _symbols(ids):
  ids = [int(i) for i in ids]
  assert ids[-1] == tokenizers.EOS_ID
  return ids[:-1]


@pytest.mark.parametrize('task', algorithmic.TASKS)
def test_algorithmic_examples_solve_their_task(task):
  rng = np.random.default_rng(0)
  for length in (3, 7, 40):
    inputs, targets = algorithmic.generate(task, length, rng)
    inputs, targets = _symbols(inputs), _symbols(targets)
    assert len(inputs) == length
    if task == 'addition':
      plus = inputs.index(algorithmic.PLUS_ID)
      # Least significant digit first.
      number = lambda ids: int(''.join(str(i - 2) for i in reversed(ids)))
      assert number(targets) == number(inputs[:plus]) + number(
          inputs[plus + 1:])
    else:
      expected = {'copy': inputs, 'reverse': inputs[::-1],
                  'sort': sorted(inputs)}[task]
      assert targets == expected


def _build_algorithmic(data_dir, **options):
  config = builder_config.named(algorithmic.AlgorithmicConfig, **options)
  builder = algorithmic.Algorithmic(config=config, data_dir=str(data_dir),
                                    file_format='array_record')
  builder.download_and_prepare()
  return builder.as_data_source()


def _inputs(split):
  return [tuple(split[i]['inputs']) for i in range(len(split))]


def test_algorithmic_builder_is_deterministic_and_splits_disjoint(tmp_path):
  options = dict(task='sort', num_train=300, num_eval=50, max_length=8,
                 long_max_length=12)
  first = _build_algorithmic(tmp_path / 'a', **options)
  second = _build_algorithmic(tmp_path / 'b', **options)
  for split in ('train', 'validation', 'long'):
    assert sorted(_inputs(first[split])) == sorted(_inputs(second[split]))
  train = set(_inputs(first['train']))
  assert not train & set(_inputs(first['validation']))
  assert not train & set(_inputs(first['long']))
  assert max(len(x) for x in _inputs(first['train'])) <= 8 + 1
  assert min(len(x) for x in _inputs(first['long'])) > 8 + 1


# --- listops ---


def evaluate_listops(ids) -> int:
  """An independent evaluator: a stack machine over the token sequence."""
  names = {v: k for k, v in listops.OPERATOR_IDS.items()}
  stack = []
  for token in (int(i) for i in ids if int(i) != 0):
    if token in names:
      stack.append([names[token]])
    elif token == listops.CLOSE_ID:
      operator, *arguments = stack.pop()
      value = {'[MIN': min, '[MAX': max,
               '[MED': lambda a: int(np.median(a)),
               '[SM': lambda a: sum(a) % 10}[operator](arguments)
      if stack:
        stack[-1].append(value)
      else:
        return value
    else:
      digit = token - listops.DIGIT_OFFSET
      if not stack:
        return digit
      stack[-1].append(digit)
  raise AssertionError('unbalanced expression')


def test_listops_labels_match_an_independent_evaluator(tmp_path):
  config = builder_config.named(listops.ListOpsConfig, min_length=5,
                                max_length=60, num_train=200, num_eval=20)
  builder = listops.ListOps(config=config, data_dir=str(tmp_path),
                            file_format='array_record')
  builder.download_and_prepare()
  sources = builder.as_data_source()
  seen = set()
  for split in ('train', 'validation', 'test'):
    for i in range(len(sources[split])):
      example = sources[split][i]
      assert 5 < len(example['inputs']) < 60
      assert example['label'] == evaluate_listops(example['inputs'])
      key = tuple(example['inputs'])
      assert key not in seen
      seen.add(key)
  labels = [sources['train'][i]['label'] for i in range(200)]
  assert len(set(labels)) >= 5


def test_listops_text_form():
  ids = [listops.OPERATOR_IDS['[MAX'], 4, listops.OPERATOR_IDS['[SM'], 11, 9,
         listops.CLOSE_ID, listops.CLOSE_ID]
  assert listops.tokens_to_text(ids) == '[MAX 2 [SM 9 7 ] ]'
  assert evaluate_listops(ids) == 6


# --- pipeline ---


def _lm_dataset(documents):
  split = grain.MapDataset.source(
      [{'tokens': np.concatenate([[1], d]).astype(np.int32)}
       for d in documents])
  return datasets.Dataset(tasks.LM, {'train': split, 'validation': split}, 100)


@pytest.mark.parametrize('max_segments', [None, 2])
def test_lm_batches_hold_each_document_once_with_shifted_targets(
    max_segments):
  """Packed rows (of at most `max_segments` windows, where bounded)."""
  documents = [np.arange(2, 2 + n) for n in (3, 20, 7, 1, 9, 2, 1, 1)]
  dataset = _lm_dataset(documents)
  batches = list(pipeline.eval_batches(dataset, 'validation', seq_len=8,
                                       batch_size=2, num_batches=-1,
                                       max_segments=max_segments))
  all_targets, most_segments = [], 0
  for batch in batches:
    assert batch['inputs'].shape == (2, 8)
    for row in range(2):
      segments = batch['segment_ids'][row]
      most_segments = max(most_segments, len(set(segments[segments > 0])))
      for segment in set(segments[segments > 0]):
        where = segments == segment
        inputs = batch['inputs'][row][where]
        targets = batch['targets'][row][where]
        np.testing.assert_array_equal(batch['positions'][row][where],
                                      np.arange(where.sum()))
        np.testing.assert_array_equal(inputs[1:], targets[:-1])
        all_targets += targets.tolist()
      np.testing.assert_array_equal(batch['weights'][row],
                                    (segments > 0).astype(np.float32))
  # Every token of every document is a target exactly once.
  assert sorted(all_targets) == sorted(np.concatenate(documents).tolist())
  assert most_segments == (max_segments or 4)


def test_eval_batches_pad_to_the_requested_count():
  documents = [np.arange(2, 2 + n) for n in (3, 5)]
  batches = list(pipeline.eval_batches(_lm_dataset(documents), 'validation',
                                       seq_len=8, batch_size=4,
                                       num_batches=3))
  assert len(batches) == 3
  assert all(b['inputs'].shape == (4, 8) for b in batches)
  assert sum(b['weights'].sum() for b in batches) == 3 + 5
  assert batches[2]['weights'].sum() == 0


@pytest.mark.core
def test_seq2seq_batches_shift_targets_and_drop_long_examples():
  examples = [{'inputs': np.array([5, 6, 1], np.int32),
               'targets': np.array([6, 5, 1], np.int32)},
              {'inputs': np.arange(2, 12, dtype=np.int32),
               'targets': np.array([3, 1], np.int32)}]
  dataset = datasets.Dataset(
      tasks.SEQ2SEQ, {'validation': grain.MapDataset.source(examples)}, 13)
  (batch,) = pipeline.eval_batches(dataset, 'validation', seq_len=4,
                                   batch_size=2, num_batches=-1)
  np.testing.assert_array_equal(batch['inputs'][0], [5, 6, 1, 0])
  np.testing.assert_array_equal(batch['targets'][0], [6, 5, 1, 0])
  np.testing.assert_array_equal(batch['decoder_inputs'][0], [0, 6, 5, 1])
  np.testing.assert_array_equal(batch['weights'][0], [1, 1, 1, 0])
  np.testing.assert_array_equal(batch['weights'][1], 0)  # Padding example.


def assert_resumes(make_iterator, consumed: int, compared: int) -> None:
  """A fresh iterator set to the state after `consumed` batches yields the
  same next `compared` batches as the original."""
  iterator = make_iterator()
  for _ in range(consumed):
    next(iterator)
  state = iterator.get_state()
  expected = [next(iterator) for _ in range(compared)]
  resumed = make_iterator()
  resumed.set_state(state)
  for batch in expected:
    got = next(resumed)
    for key in batch:
      np.testing.assert_array_equal(got[key], batch[key])
  iterator.close()
  resumed.close()


def test_train_iterator_resumes_at_the_same_batch(stdlib_dataset):
  assert_resumes(lambda: pipeline.train_iterator(
      stdlib_dataset, seq_len=64, batch_size=4, seed=3), consumed=3,
                 compared=2)


def test_row_owners_prepare_the_whole_batchs_rows_bitwise_and_resume_as_any(
    stdlib_dataset):
  """Batches of 4 rows prepared by 1, 2 (simulated hosts) and 4 owners of
  their rows are the same arrays; the owners' states, merged, resume one
  owner of every row, and one owner's state resumes each of 4 owners."""
  def owners(count: int):
    rows = np.array_split(np.arange(4), count)
    return [pipeline.train_iterator(stdlib_dataset, seq_len=32, batch_size=4,
                                    seed=3, rows=tuple(own), prefetch=1)
            for own in rows]

  def batches(iterators, count: int):
    got = []
    for _ in range(count):
      parts = [next(iterator) for iterator in iterators]
      assert [len(part['inputs']) for part in parts] == [
          4 // len(iterators)] * len(iterators)  # Each reads only its rows.
      got.append({key: np.concatenate([part[key] for part in parts])
                  for key in parts[0]})
    return got

  def assert_equal(got, want):
    for got_batch, want_batch in zip(got, want, strict=True):
      for key in want_batch:
        np.testing.assert_array_equal(got_batch[key], want_batch[key])

  one, two, four = owners(1), owners(2), owners(4)
  want = batches(one, 5)
  assert_equal(batches(two, 3), want[:3])
  assert_equal(batches(four, 2), want[:2])
  # As a checkpoint of several hosts holds them.
  merged = lambda iterators: pipeline.merged_rows(
      [iterator.get_state() for iterator in iterators])

  resumed = owners(1)
  resumed[0].set_state(merged(two))
  assert_equal(batches(resumed, 2), want[3:])
  split = owners(4)
  for iterator in split:
    iterator.set_state(merged(four))
  assert_equal(batches(split, 3), want[2:])
  for iterator in one + two + four + resumed + split:
    iterator.close()


def test_an_older_checkpoints_data_position_continues_or_starts_again(
    stdlib_dataset, capsys):
  """Streams were saved row by row as a list: they continue exactly. A
  position of the pipeline that read each batch whole starts the stream
  again, saying so."""
  def iterator(layout):
    return pipeline.train_iterator(stdlib_dataset, seq_len=32, batch_size=2,
                                   seed=3, layout=layout, prefetch=1)
  streams = iterator('streams')
  next(streams)
  state = streams.get_state()
  expected = next(streams)
  resumed = iterator('streams')
  resumed.set_state({'rows': [state['rows']['0'], state['rows']['1']]})
  np.testing.assert_array_equal(next(resumed)['inputs'], expected['inputs'])
  packed, fresh = iterator('packed'), iterator('packed')
  packed.set_state({'parent': {'next_index': 7}})
  assert 'the training data starts again' in capsys.readouterr().out
  np.testing.assert_array_equal(next(packed)['inputs'],
                                next(fresh)['inputs'])
  for each in (streams, resumed, packed, fresh):
    each.close()

# --- Dataset loading errors ---


def _config(**overrides):
  return TrainConfig(**overrides)


def test_unprepared_tfds_dataset_says_how_to_prepare_it(tmp_path):
  config = _config(dataset='lm1b', data_dir=str(tmp_path))
  with pytest.raises(InputError, match='tfds build lm1b .*array_record'):
    datasets.load(config, str(tmp_path / 'workdir'))


class SlowBuilder:
  """A builder whose build takes a while and, like tfds's, fails when
  another process finished the same build first."""

  name = 'slow'
  data_dir = 'unused'
  info = types.SimpleNamespace(metadata=None)  # Records nothing.

  def __init__(self, state: dict):
    self.state = state

  def is_prepared(self) -> bool:
    return self.state['built']

  def download_and_prepare(self) -> None:
    if self.state['built']:
      return
    self.state['builds'] += 1
    time.sleep(0.3)
    if self.state['built']:
      raise OSError('Cannot rename ...: destination already exists.')
    self.state['built'] = True

  def as_data_source(self) -> dict:
    return {'train': types.SimpleNamespace(
        split='train', dataset_info=types.SimpleNamespace(splits={}))}


def test_processes_that_build_one_dataset_at_once_take_turns(tmp_path):
  """Trials of a sweep start together: one builds, the others wait and
  find the dataset built."""
  state = {'built': False, 'builds': 0}
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    loads = [pool.submit(datasets._build, lambda: SlowBuilder(state),
                         str(tmp_path)) for _ in range(3)]
    for load in loads:
      sources, metadata = load.result()
      assert set(sources) == {'train'} and metadata == {}
  assert state['builds'] == 1


def test_unknown_dataset_option_is_named(tmp_path):
  config = _config(dataset='listops', data_dir=str(tmp_path),
                   dataset_options={'max_len': 10})
  with pytest.raises(InputError,
                     match=r'unknown key config\.dataset_options\.max_len'):
    datasets.load(config, str(tmp_path))


def test_in_memory_windows_cover_documents_as_the_pipeline_does():
  documents = [np.arange(1, 1 + n, dtype=np.int32) for n in (3, 20, 7, 2, 9)]
  windows = layouts.in_memory_windows([{'tokens': d} for d in documents],
                                       seq_len=8)
  assert all(len(windows[i]['tokens']) <= 9 for i in range(len(windows)))

  def targets(dataset):
    batches = pipeline.eval_batches(dataset, 'validation', seq_len=8,
                                    batch_size=2, num_batches=-1)
    return sorted(t for b in batches for t in b['targets'][b['weights'] > 0])

  as_windows = datasets.Dataset(
      tasks.LM, {'validation': grain.MapDataset.source(windows)}, 100)
  as_documents = datasets.Dataset(
      tasks.LM, {'validation': grain.MapDataset.source(
          [{'tokens': d} for d in documents])}, 100)
  assert targets(as_windows) == targets(as_documents)
  assert len(targets(as_windows)) == sum(len(d) - 1 for d in documents)


@pytest.mark.core
def test_streams_continue_each_row_across_batches():
  documents = [np.arange(100 * d + 1, 100 * d + n + 1) for d, n in
               enumerate((5, 12, 3, 9, 7, 4))]
  dataset = _lm_dataset(documents)
  batches = list(pipeline.eval_batches(dataset, 'validation', seq_len=4,
                                       batch_size=2, num_batches=-1,
                                       layout='streams'))
  for row in range(2):
    targets = np.concatenate([b['targets'][row][b['weights'][row] > 0]
                              for b in batches])
    inputs = np.concatenate([b['inputs'][row][b['weights'][row] > 0]
                             for b in batches])
    # Row r reads documents r, r + 2, ... whole, in order, EOS first.
    own = [np.concatenate([[1], d]) for d in documents[row::2]]
    np.testing.assert_array_equal(targets,
                                  np.concatenate([d[1:] for d in own]))
    np.testing.assert_array_equal(inputs,
                                  np.concatenate([d[:-1] for d in own]))


def test_streams_resume_in_the_middle_of_a_document(stdlib_dataset):
  assert_resumes(lambda: pipeline.train_iterator(
      stdlib_dataset, seq_len=32, batch_size=2, seed=1, layout='streams'),
                 consumed=5, compared=3)
