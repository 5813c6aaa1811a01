"""Hugging Face tokenizers (tokenizer.json, trained here like GPT-2's and
Llama 3's): exact round trips, the document boundary each names, text
datasets tokenized by them that train, and refusals by key."""

import pathlib
import re

import numpy as np
import pytest
import transformers

from tests.helpers import hf_tokenizers, tiny_runs
from train.base.errors import InputError
from train.config import validation as config_validation
from train.data import datasets, tokenizers
from train.run import trained_run
from train.run import workdir as workdir_lib
from train.run.trainer import train_and_evaluate

VOCAB = 300


@pytest.fixture(scope='module')
def trained(tmp_path_factory) -> dict[str, str]:
  """{kind: its tokenizer.json}."""
  root = tmp_path_factory.mktemp('tokenizers')
  return {kind: hf_tokenizers.train(kind, root / kind, VOCAB)
          for kind in ('gpt2', 'llama')}


@pytest.mark.core
@pytest.mark.parametrize('kind,boundary', [('gpt2', '<|endoftext|>'),
                                           ('llama', '<|begin_of_text|>')])
def test_text_round_trips_and_documents_start_with_the_named_token(
    trained, kind, boundary):
  tokenizer = tokenizers.HfTokenizer(trained[kind])
  assert tokenizer.vocab_size == VOCAB
  texts = hf_tokenizers.sample_texts(40)[30:]  # Not trained on.
  for text in texts:
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and len(ids) < len(text.encode())
    assert tokenizer.decode(ids) == text
  # The boundary decodes to nothing; GPT-2's is its only special token,
  # Llama's the tokenizer_config.json's bos_token.
  assert tokenizer.decode([tokenizer.eos_id]) == ''
  assert tokenizer._tokenizer.id_to_token(tokenizer.eos_id) == boundary


@pytest.mark.core
@pytest.mark.parametrize('kind', ['gpt2', 'llama'])
def test_a_prompt_is_encoded_as_transformers_encodes_it(trained, kind):
  """A prompt's ids are transformers' for the same tokenizer.json: its
  post-processor's (Llama's <|begin_of_text|> first, GPT-2's nothing),
  and a boundary typed in the text is the boundary token."""
  tokenizer = tokenizers.HfTokenizer(trained[kind])
  reference = transformers.PreTrainedTokenizerFast(
      tokenizer_file=trained[kind])
  boundary = tokenizer._tokenizer.id_to_token(tokenizer.eos_id)
  for prompt in ('def f', f'{boundary}def f'):
    assert (list(tokenizer.encode_prompt(prompt))
            == reference(prompt)['input_ids'])
  assert tokenizer.encode_prompt('def f')[0] == (
      tokenizer.eos_id if kind == 'llama' else tokenizer.encode('def f')[0])


@pytest.fixture(scope='module')
def corpus(tmp_path_factory) -> str:
  """A glob of 60 text files."""
  return hf_tokenizers.write_corpus(tmp_path_factory.mktemp('corpus'))


def test_a_corpus_of_files_and_the_standard_library_train_in_their_tokens(
    trained, corpus, data_dir, tmp_path, monkeypatch):
  """text_files (Llama's tokens) and python_stdlib_bytes (GPT-2's) each
  train 3 steps, the tokenizer's files copied into the workdir and its
  config.json naming the copy, which a workdir moved takes with it; the
  documents the run read start with the tokenizer's boundary."""
  # The dataset each run loads, kept: tokenizing the library again would
  # take seconds.
  read, load = [], datasets.load

  def load_and_keep(*args):
    read.append(load(*args))
    return read[-1]
  monkeypatch.setattr(datasets, 'load', load_and_keep)
  for dataset, kind, options in (
      ('text_files', 'llama', {'paths': corpus}),
      ('python_stdlib_bytes', 'gpt2', {})):
    config = tiny_runs.tiny_config('lm_stdlib', data_dir)
    config.update(dataset=dataset, tokenizer=trained[kind],
                  num_train_steps=3, eval_every=3, checkpoint_every=3,
                  num_eval_steps=1, sample_length=0)
    config.dataset_options = options
    config.model.vocab_size = VOCAB
    summary = train_and_evaluate(config, str(tmp_path / dataset))
    assert np.isfinite(summary['eval_loss'])
    moved = tmp_path / f'{dataset}_moved'
    (tmp_path / dataset).rename(moved)
    recorded = trained_run.load_config(str(moved))
    assert (recorded.dataset, recorded.dataset_options.to_dict(),
            recorded.tokenizer) == (dataset, options,
                                    str(moved / 'tokenizer.json'))
    assert workdir_lib.run_config(str(moved))['tokenizer'] == 'tokenizer.json'
    # Llama's boundary, its tokenizer_config.json's bos_token, came too.
    eos_id = tokenizers.HfTokenizer(trained[kind]).eos_id
    assert tokenizers.HfTokenizer(recorded.tokenizer).eos_id == eos_id
    assert (moved / 'tokenizer.json').read_bytes() == (
        pathlib.Path(trained[kind]).read_bytes())
    tokens = read.pop().splits['validation'][0]['tokens']
    assert tokens[0] == eos_id


def test_mistakes_are_refused_naming_the_key(trained, corpus, data_dir,
                                             tmp_path):
  """A tokenizer of more ids than the model reads, a dataset it does not
  tokenize."""
  config = tiny_runs.tiny_config('lm_stdlib', data_dir)
  config.update(dataset='text_files', tokenizer=trained['gpt2'])
  config.dataset_options = {'paths': corpus}
  checked = config_validation.validate(config)
  with pytest.raises(InputError, match=re.escape(
      f"config.model.vocab_size=258 is smaller than the {VOCAB} token ids "
      "of config.dataset='text_files' tokenized by "
      f"config.tokenizer={trained['gpt2']!r}.")):
    config_validation.check_dataset_fits(
        checked, datasets.load(checked, str(tmp_path)))
  config.update(dataset='lm1b', dataset_options={}, track_corpus='')
  with pytest.raises(InputError, match=re.escape(
      f"config.tokenizer={trained['gpt2']!r} tokenizes python_stdlib_bytes "
      "and text_files, not config.dataset='lm1b'")):
    datasets.load(config_validation.validate(config), str(tmp_path))
