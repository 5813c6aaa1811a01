"""Tokenizers in Hugging Face's tokenizer.json format, trained here with
the `tokenizers` package on a sample of the standard library (no network):
one like GPT-2's (byte-level BPE, <|endoftext|> its only special token,
no post-processor) and one like Llama 3's (byte-level BPE after its
splitting pattern, <|begin_of_text|> and <|end_of_text|>, named in a
tokenizer_config.json; its post-processor puts <|begin_of_text|> before
a text encoded with special tokens)."""

import json
import pathlib

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers import processors, trainers

from train.data import stdlib

# Llama 3's pre-tokenizer pattern (tiktoken's cl100k).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
                 r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|"
                 r"\s+")


def sample_texts(count: int = 30) -> list[str]:
  """The first `count` files of the standard library corpus."""
  root = stdlib.stdlib_root()
  return [(root / path).read_text() for path in
          stdlib.source_files(root)[:count]]


def write_corpus(directory: pathlib.Path, count: int = 60) -> str:
  """`count` files of the standard library corpus as text files in
  `directory`; returns their glob (config.dataset_options.paths of
  text_files)."""
  directory.mkdir(parents=True, exist_ok=True)
  for number, text in enumerate(sample_texts(count)):
    (directory / f'{number:02d}.txt').write_text(text)
  return str(directory / '*.txt')


def train(kind: str, directory: pathlib.Path, vocab_size: int) -> str:
  """Trains the `kind` ('gpt2' or 'llama') tokenizer of `vocab_size` ids
  into `directory`; returns its tokenizer.json's path."""
  tokenizer = Tokenizer(models.BPE())
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                        use_regex=kind == 'gpt2')
  special = (['<|endoftext|>'] if kind == 'gpt2'
             else ['<|begin_of_text|>', '<|end_of_text|>'])
  tokenizer.pre_tokenizer = byte_level if kind == 'gpt2' else (
      pre_tokenizers.Sequence([pre_tokenizers.Split(
          Regex(_LLAMA3_SPLIT), behavior='isolated'), byte_level]))
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(sample_texts(), trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=special, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if kind == 'llama':
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f'{special[0]} $A', special_tokens=[
            (special[0], tokenizer.token_to_id(special[0]))])
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(directory / 'tokenizer.json'))
  if kind == 'llama':
    (directory / 'tokenizer_config.json').write_text(json.dumps(
        {'bos_token': special[0], 'eos_token': special[1]}))
  return str(directory / 'tokenizer.json')
