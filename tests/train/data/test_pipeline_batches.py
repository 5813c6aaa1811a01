"""The training and evaluation batches of a language model, bit for bit, and
the iterator's saved positions, against a fixture written by an earlier
pipeline (tests/train/data/pipeline_batches.npz): computing them faster
must not change them, nor what a checkpoint holds.

  python -m tests.train.data.test_pipeline_batches   # writes the fixture

The dataset is made here from arithmetic (no corpus, no random generator),
so the fixture holds on any Python and numpy.
"""

import json
import pathlib
import sys

import grain
import numpy as np
import pytest

from train.data import datasets, pipeline, tasks

FIXTURE = pathlib.Path(__file__).with_name('pipeline_batches.npz')
SEQ_LEN, BATCH, BATCHES = 8, 4, 24
RESUME_AT = 13  # Batches consumed before the saved position resumed from.


def _documents() -> list[np.ndarray]:
  """Documents of 1 to 31 tokens (EOS first; one of EOS alone, which has no
  target), enough windows of 8 for about two epochs of BATCHES."""
  lengths = [(7 * d * d + 3 * d) % 31 + 1 for d in range(13)]
  return [np.concatenate([[1], (d * 31 + 7 * np.arange(n - 1)) % 97 + 2])
          .astype(np.int32) for d, n in enumerate(lengths)]


def _dataset(in_memory: bool) -> datasets.Dataset:
  split = grain.MapDataset.source([{'tokens': d} for d in _documents()])
  return datasets.Dataset(tasks.LM, {'train': split, 'validation': split},
                          100, shuffle_windows=in_memory)


# name: (documents held in memory (windows shuffled one by one), layout,
# max_segments, seed).
TRAIN_CASES = {
    'memory_packed': (True, 'packed', None, 3),
    'memory_packed_bounded': (True, 'packed', 2, 3),
    'memory_padded': (True, 'padded', None, 4),
    'documents_packed': (False, 'packed', None, 5),
    'documents_padded': (False, 'padded', None, 5),
}
EVAL_CASES = {'eval_packed': 'packed', 'eval_padded': 'padded'}


def train_iterator(case: str, rows=None):
  in_memory, layout, max_segments, seed = TRAIN_CASES[case]
  return pipeline.train_iterator(
      _dataset(in_memory), seq_len=SEQ_LEN, batch_size=BATCH, seed=seed,
      layout=layout, max_segments=max_segments, rows=rows, prefetch=1)


def _stacked(case: str, batches: list[dict]) -> dict[str, np.ndarray]:
  return {f'{case}/{key}': np.stack([batch[key] for batch in batches])
          for key in batches[0]}


def computed() -> dict[str, np.ndarray]:
  """Every case's batches, stacked ('<case>/<key>': [batches, B, L]), and
  the training iterators' states after each batch ('<case>/states',
  JSON)."""
  arrays = {}
  for case in TRAIN_CASES:
    iterator, batches, states = train_iterator(case), [], []
    for _ in range(BATCHES):
      batches.append(next(iterator))
      states.append(iterator.get_state())
    iterator.close()
    arrays |= _stacked(case, batches)
    arrays[f'{case}/states'] = np.array(json.dumps(states))
  for case, layout in EVAL_CASES.items():
    arrays |= _stacked(case, list(pipeline.eval_batches(
        _dataset(False), 'validation', seq_len=SEQ_LEN, batch_size=BATCH,
        num_batches=-1, layout=layout)))
  return arrays


@pytest.fixture(scope='module')
def fixture() -> dict[str, np.ndarray]:
  with np.load(FIXTURE) as stored:
    return dict(stored)


def batches_of(arrays: dict, case: str) -> list[dict[str, np.ndarray]]:
  stacked = {name.split('/')[1]: value for name, value in arrays.items()
             if name.startswith(f'{case}/') and not name.endswith('/states')}
  return [{key: value[index] for key, value in stacked.items()}
          for index in range(len(next(iter(stacked.values()))))]


def assert_same(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    assert got[key].dtype == value.dtype, key
    np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_the_batches_and_saved_positions_are_the_fixtures(fixture):
  arrays = computed()
  assert sorted(arrays) == sorted(fixture)
  for name, value in fixture.items():
    if name.endswith('/states'):
      assert json.loads(str(arrays[name])) == json.loads(str(value)), name
    else:
      assert arrays[name].dtype == value.dtype, name
      np.testing.assert_array_equal(arrays[name], value, err_msg=name)


@pytest.mark.parametrize('case', ['memory_packed', 'documents_packed',
                                  'memory_padded'])
def test_row_owners_resume_from_a_saved_position_to_the_fixtures_batches(
    fixture, case):
  """Owners of some rows each (hosts), restored from the fixture's saved
  position in the middle of an epoch and of a packing round, give the
  fixture's rows from there on."""
  want = batches_of(fixture, case)
  saved = json.loads(str(fixture[f'{case}/states']))[RESUME_AT - 1]
  owners = [train_iterator(case, rows) for rows in ((0,), (1, 2, 3))]
  for owner in owners:
    owner.set_state(saved)
  for batch in want[RESUME_AT:]:
    parts = [next(owner) for owner in owners]
    assert_same({key: np.concatenate([part[key] for part in parts])
                 for key in batch}, batch)
  states = [owner.get_state() for owner in owners]
  assert pipeline.merged_rows(states) == json.loads(
      str(fixture[f'{case}/states']))[-1]
  for owner in owners:
    owner.close()


if __name__ == '__main__':
  np.savez_compressed(FIXTURE, **computed())
  print(f'wrote {FIXTURE}', file=sys.stderr)
