"""A workdir read elsewhere: a variant its config file registered is
registered again by each reader (or the file named where it is gone), and
its tokenizer goes with it, on a disk and on gs://."""

import json
import re

import jax
import pytest

from configs import published
from model import attention
from tests.helpers import tiny_runs
from train import cli
from train.base import storage
from train.base.errors import InputError
from train.run import trained_run, workdir as workdir_lib
from train.run.program import Program

# A config file that registers the variant it trains, as docs/attention.md
# says to.
HALVED = '''
from configs import default
from model import attention
from model.attention.variants import flex_variant
from tests.helpers import tiny_runs


def halved(s, data, q_index, k_index, head):
  return s * 0.5


attention.register('halved', flex_variant.variant(name='halved',
                                                  score=halved))


def get_config():
  config = tiny_runs.tiny_config('lm_stdlib', {data_dir!r})
  config.model.attention = 'halved'
  config.model.attention_options = default.attention_options()
  config.sample_length = 0  # It reads no key/value cache.
  return config
'''


@pytest.fixture
def built_in(monkeypatch) -> dict:
  """The registry as a new process holds it; what a test registers is
  undone after it."""
  monkeypatch.setattr(attention, '_ADDED', {})
  registry = dict(attention._REGISTRY)
  monkeypatch.setattr(attention, '_REGISTRY', dict(registry))
  return registry


def _halved_config(tmp_path, data_dir):
  """(the config file HALVED, its config, loaded as train.train loads it:
  'halved' registered)."""
  config_file = tmp_path / 'halved.py'
  config_file.write_text(HALVED.format(data_dir=data_dir))
  return config_file, cli.load_config(str(config_file), {})


def test_a_variant_its_config_file_registered_is_registered_by_readers(
    built_in, monkeypatch, tmp_path, data_dir):
  """The run records the file; configs/published.py:from= (transplant's
  reader too) and trained_run.load_config (train.generate's, whose
  program checks the config) register the variant again by running it,
  in a process that had not."""
  config_file, config = _halved_config(tmp_path, data_dir)
  workdir = tmp_path / 'run'
  with workdir_lib.claim(config, str(workdir)):
    pass
  assert json.loads((workdir / 'registered.json').read_text()) == {
      'attention': {'halved': str(config_file)}}
  for read in (
      lambda: published.get_config(f'from={workdir}').model.attention,
      lambda: Program.from_config(trained_run.load_config(str(workdir)),
                                  jax.devices()[:1]).model_config.attention):
    monkeypatch.setattr(attention, '_REGISTRY', dict(built_in))
    assert read() == 'halved'


def test_a_reader_names_the_file_that_registered_a_variant_once_gone(
    built_in, monkeypatch, tmp_path, data_dir):
  config_file, config = _halved_config(tmp_path, data_dir)
  with workdir_lib.claim(config, str(tmp_path / 'run')):
    pass
  config_file.unlink()
  monkeypatch.setattr(attention, '_REGISTRY', dict(built_in))
  with pytest.raises(InputError, match=re.escape(
      f"the run in {tmp_path / 'run'} names config.model.attention="
      f"'halved', which {config_file} registered (its registered.json), and "
      f'{config_file} is gone: restore it, or register the variant before '
      'reading the run.')):
    trained_run.load_config(str(tmp_path / 'run'))


def _tokenized_config(tmp_path, data_dir, content: str = '{}'):
  """A config whose config.tokenizer names a directory holding a
  tokenizer.json of `content` and a tokenizer_config.json (their bytes
  are copied, not read)."""
  source = tmp_path / 'tokenizer'
  source.mkdir(exist_ok=True)
  (source / 'tokenizer.json').write_text(content)
  (source / 'tokenizer_config.json').write_text('{"bos_token": "<s>"}')
  config = tiny_runs.tiny_config('lm_stdlib', data_dir)
  config.tokenizer = str(source)
  return config


def test_a_run_on_a_bucket_holds_its_tokenizer(object_store, tmp_path,
                                               data_dir):
  """config.tokenizer's files are copied into a gs:// workdir, and a reader
  of the run reads them there."""
  workdir = f'{object_store}/{tmp_path.name}/run'
  with workdir_lib.claim(_tokenized_config(tmp_path, data_dir), workdir):
    pass
  recorded = trained_run.load_config(workdir).tokenizer
  assert recorded == f'{workdir}/tokenizer.json'
  assert storage.path(recorded).read_text() == '{}'
  assert storage.path(f'{workdir}/tokenizer_config.json').read_text() == (
      '{"bos_token": "<s>"}')


def test_a_resume_with_another_tokenizer_is_refused(tmp_path, data_dir):
  workdir = tmp_path / 'run'
  with workdir_lib.claim(_tokenized_config(tmp_path, data_dir), str(workdir)):
    (workdir / 'metrics.jsonl').write_text('{"step": 1}\n')
  with pytest.raises(InputError, match=re.escape(
      f"config.tokenizer='{tmp_path / 'tokenizer'}': its tokenizer.json is "
      f"not the one this run started with ({workdir / 'tokenizer.json'}); "
      'a run keeps its tokenizer')):
    workdir_lib.claim(_tokenized_config(tmp_path, data_dir, '{"v": 2}'),
                      str(workdir))


def test_a_run_recorded_before_its_tokenizer_was_kept_resumes_on_its_path(
    tmp_path, data_dir):
  """A workdir whose config.json names the tokenizer's own path (no copy
  in it) resumes with the same command, still naming that path."""
  workdir = tmp_path / 'run'
  config = _tokenized_config(tmp_path, data_dir)
  with workdir_lib.claim(config, str(workdir)):
    (workdir / 'metrics.jsonl').write_text('{"step": 1}\n')
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    (workdir / name).unlink()
  recorded = json.loads((workdir / 'config.json').read_text())
  recorded['tokenizer'] = config.tokenizer
  (workdir / 'config.json').write_text(json.dumps(recorded))
  with workdir_lib.claim(config, str(workdir)):
    pass
  assert workdir_lib.run_config(str(workdir))['tokenizer'] == config.tokenizer
  assert not (workdir / 'tokenizer.json').exists()
