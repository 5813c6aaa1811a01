"""What a run's workdir holds so that it can be read anywhere, moved,
copied or after its sources are gone: the tokenizer it reads, copied in
when it starts (config.json names the copy relative to the workdir), and
which file registered each attention variant it names that is not built
in (REGISTERED), which a reader runs again."""

import copy
import json
import os
import pathlib
import runpy
from typing import Any

import ml_collections

from model import attention
from train.base import storage
from train.base.errors import InputError
from train.data import tokenizers

# The variants a run names that files registered: {'attention': {name:
# the file, relative to the repository where it lies in it; None: no
# file}}.
REGISTERED = 'registered.json'
_REPO = pathlib.Path(__file__).resolve().parents[2]


def recorded(config: ml_collections.ConfigDict, workdir: str, *,
             new: bool) -> ml_collections.ConfigDict:
  """`config` as `workdir` records it, once the workdir holds what a reader
  needs beside it (called at each start, before the record is written or a
  resume checked): config.tokenizer's files copied in and named relative
  to it, and REGISTERED written. InputError where a run's workdir (not
  `new`) holds another tokenizer: a run keeps its own. A run that started
  before tokenizers were kept (no copy) goes on naming its path."""
  _record_registrations(config, workdir)
  if config.get('tokenizer') is None or not new and not (
      storage.path(workdir) / tokenizers.HF_TOKENIZER).exists():
    return config  # None, or a run recorded before its tokenizer was kept.
  for name, source in tokenizers.hf_files(config.tokenizer).items():
    kept = storage.path(workdir) / name
    data = source.read_bytes()
    if new or not kept.exists():
      storage.write_whole(kept, data)
    elif kept.read_bytes() != data:
      raise InputError(
          f'config.tokenizer={config.tokenizer!r}: its {name} is not the '
          f'one this run started with ({kept}); a run keeps its tokenizer: '
          'give another --workdir for another.')
  config = copy.deepcopy(config)
  config.tokenizer = tokenizers.HF_TOKENIZER
  return config


def _record_registrations(config: ml_collections.ConfigDict,
                          workdir: str) -> None:
  """REGISTERED in `workdir`, of the variants config.model.attention names
  that are not built in (none: nothing written)."""
  named = config.model.get('attention')
  named = {named} if isinstance(named, str) else set(named or ())
  files = {name: file and _relative(file)
           for name, file in attention.added().items() if name in named}
  if files:
    storage.write_whole(storage.path(workdir) / REGISTERED,
                        json.dumps({'attention': files}, indent=1) + '\n')


def _relative(file: str) -> str:
  """`file` relative to the repository where it lies in it (a clone
  elsewhere holds it there too), else as it is."""
  path = pathlib.Path(file)
  return str(path.relative_to(_REPO)) if path.is_relative_to(_REPO) else file


def readable(workdir: str, values: dict[str, Any]) -> dict[str, Any]:
  """The config `values` recorded in `workdir` (nested or flat) as a
  reader reads them, the variants they name registered
  (`_register_variants`): config.tokenizer the copy the run made, named
  relative to the workdir, there (an older run's path or URL as it is)."""
  _register_variants(workdir)
  tokenizer = values.get('tokenizer')
  if tokenizer is None or storage.is_object_store(tokenizer) or (
      os.path.isabs(tokenizer)):
    return values
  return values | {'tokenizer': str(storage.path(workdir) / tokenizer)}


def _register_variants(workdir: str) -> None:
  """Registers each variant of REGISTERED in `workdir` not registered yet,
  by running the file that registered it; InputError naming the variant
  and the file where that cannot be done."""
  path = storage.path(workdir) / REGISTERED
  if not path.exists():
    return
  for name, file in json.loads(path.read_text())['attention'].items():
    if name in attention.names():
      continue
    said = (f'the run in {workdir} names config.model.attention={name!r}, '
            f'which {file or "code in no file"} registered (its '
            f'{REGISTERED})')
    if file is None:
      raise InputError(f'{said}: register it before reading the run.')
    located = _REPO / file
    if not located.is_file():
      raise InputError(f'{said}, and {located} is gone: restore it, or '
                       'register the variant before reading the run.')
    runpy.run_path(str(located))
    if name not in attention.names():
      raise InputError(f'{said}; running {located} no longer registers it: '
                       'register it at the file\'s top level, or before '
                       'reading the run.')
