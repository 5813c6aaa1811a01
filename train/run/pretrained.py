"""Hugging Face model directories on disk (`config.json` and
`*.safetensors`, as PyTorch or Flax wrote them): read onto `decoder_lm`'s
parameter tree, and written from it, by format (hf_formats.FORMATS, which
`experiments.import_checkpoint --format` and `export_checkpoint --format`
name).

Reading turns config.json into `config.model` keys (refusing, by its key,
what the model cannot express) and the tensors into parameters, each
tensor's shape checked against those keys. Writing gives PyTorch's names
and layout (what transformers' classes of either framework load).
The tokenizer.json beside them is the import's and the export's to copy
(experiments/import_checkpoint.py), not read here.
"""

from collections.abc import Callable, Mapping
import glob
import json
import os
from typing import Any

# Importing flax imports jax, which makes bfloat16 (most Llama checkpoints'
# dtype) a numpy dtype that safetensors reads.
from flax import traverse_util
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from train.base import storage
from train.base.errors import InputError
from train.run.hf_formats import FORMATS, HfConfig

# The readout's tensors (of a model that does not tie it to the embedding).
_HEAD = 'lm_head.'


class Tensors:
  """A checkpoint's tensors by canonical name, in PyTorch's layout: `.weight`
  for every matrix, vector and table (a Linear's [out, in], GPT-2's Conv1D
  [in, out]), `.bias` for biases. Flax's files name a matrix `.kernel` in
  the transposed layout, a table `.embedding` and a norm's gain `.scale`:
  they are renamed (and matrices transposed) as they are read.

  `take(name, shape)` reads a tensor, once, checking its shape (the files
  are opened, not read, until then: one tensor at a time is in memory
  beside what was taken); `drop` leaves one unread; `done()` refuses
  tensors left over that no parameter read."""

  def __init__(self, directory: str, prefixes: tuple[str, ...],
               ignored: Callable[[str], bool]):
    self.directory = directory
    files = sorted(glob.glob(os.path.join(directory, '*.safetensors')))
    if not files:
      raise InputError(f'--from={directory} holds no *.safetensors file: '
                       'save the model with safe_serialization=True.')
    # Canonical name -> (the file open, the name there, transposed).
    self._tensors = {}
    for path in files:
      try:
        opened = safe_open(path, framework='numpy')
      except Exception as error:  # safetensors' errors have several types.
        raise InputError(f'{path} is not a readable safetensors file: '
                         f'{str(error).splitlines()[0][:200]}') from None
      for file_name in opened.keys():
        name = _canonical_name(file_name, prefixes)
        transposed = name.endswith('.kernel')
        if transposed:
          name = name[:-len('kernel')] + 'weight'
        if name in self._tensors:
          raise InputError(f'--from={directory}: the tensor {name} is in '
                           'more than one file.')
        if not ignored(name):
          self._tensors[name] = (opened, file_name, transposed)

  def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor `name` (float32), which must have `shape`."""
    if name not in self._tensors:
      raise InputError(f'--from={self.directory} has no tensor {name}, which '
                       'its config.json implies.')
    opened, file_name, transposed = self._tensors.pop(name)
    try:
      array = opened.get_tensor(file_name)
    except Exception as error:  # safetensors' errors have several types.
      raise InputError(f'--from={self.directory}: its tensor {file_name} '
                       'cannot be read: '
                       f'{str(error).splitlines()[0][:200]}') from None
    array = array.T if transposed else array
    if array.shape != tuple(shape):
      raise InputError(
          f'--from={self.directory}: {name} has shape {list(array.shape)}; '
          f'its config.json gives {list(shape)}.')
    return array.astype(np.float32, copy=False)

  def drop(self, name: str) -> str | None:
    """Removes the tensor `name` unread; the name its file gives it, or
    None where it has none."""
    unread = self._tensors.pop(name, None)
    return unread and unread[1]

  def done(self) -> None:
    if self._tensors:
      names = sorted(self._tensors)
      raise InputError(
          f'--from={self.directory} holds tensors this format does not '
          f'read ({len(names)}: {", ".join(names[:3])}'
          f'{", ..." if len(names) > 3 else ""}): not the architecture '
          'its config.json names.')


def _canonical_name(name: str, prefixes: tuple[str, ...]) -> str:
  for prefix in prefixes:
    if name.startswith(prefix):
      name = name[len(prefix):]
      break
  for flax_name in ('.embedding', '.scale'):
    if name.endswith(flax_name):
      return name[:-len(flax_name)] + '.weight'
  return name


def _tied_head(tensors: Tensors) -> None:
  """A tied checkpoint reads out through its embedding, as transformers
  reads it: a head beside it (Flax's save_pretrained writes one, unused)
  is left unread, with a line saying so."""
  unread = tensors.drop(f'{_HEAD}weight')
  if unread:
    print(f'--from={tensors.directory}: {unread} is not read: its '
          'config.json ties the readout to the embedding '
          '(tie_word_embeddings), as transformers reads it.', flush=True)


def model_keys(directory: str, format_name: str) -> dict[str, Any]:
  """The config.model keys of the checkpoint in `directory` read as
  `format_name`; InputError naming the file or key that does not fit."""
  if format_name not in FORMATS:
    raise InputError(f'--format={format_name!r} must be one of '
                     f'{list(FORMATS)}.')
  checkpoint_format = FORMATS[format_name]
  path = os.path.join(directory, 'config.json')
  if not os.path.isfile(path):
    raise InputError(f'--from={directory} has no config.json: it must be a '
                     'Hugging Face model directory.')
  try:
    with open(path) as f:
      values = json.load(f)
  except (OSError, ValueError) as error:
    raise InputError(f'{path} is not readable JSON: {error}') from None
  if not isinstance(values, dict):
    raise InputError(f'{path} does not hold a JSON object.')
  model_type = values.get('model_type')
  if model_type is None and isinstance(values.get('model'), dict):
    raise InputError(
        f"--from={directory} is an attnlab training run's workdir, which "
        'needs no import: fine-tune it with '
        f'--config=configs/published.py:from={directory} (config.init_from)'
        ', or sample it with python -m train.generate.')
  if model_type != checkpoint_format.model_type:
    raise InputError(
        f'{path}: model_type={model_type!r} is not the architecture '
        f'--format={format_name} reads ({checkpoint_format.model_type!r}).')
  return checkpoint_format.read_keys(HfConfig(path, values))


def params(directory: str, format_name: str, keys: Mapping[str, Any],
           place: Callable[[str, np.ndarray], Any] = lambda path, array: array
           ) -> dict:
  """The parameter tree of the checkpoint in `directory` (`keys`: its
  `model_keys`, a valid model config), each parameter `place(path,
  array)` as it is read (e.g. moved to a device, so that one tensor at a
  time is on the host); InputError naming a tensor that is missing, of
  another shape or left over."""
  checkpoint_format = FORMATS[format_name]
  tensors = Tensors(directory, checkpoint_format.prefixes,
                    checkpoint_format.ignored)
  flat = {}
  for entry in checkpoint_format.entries(keys):
    for path, array in entry.to_params(
        tensors.take(entry.name, entry.shape)).items():
      flat[path] = place(path, array)
  for path, shape in checkpoint_format.absent(keys).items():
    flat[path] = place(path, np.zeros(shape, np.float32))
  if keys['tie_embeddings']:
    _tied_head(tensors)
  tensors.done()
  return traverse_util.unflatten_dict(flat, sep='/')


def write(directory: str, params_tree: Any, format_name: str, model) -> None:
  """Writes `params_tree` (unscanned, on the host) of `model` (a
  ModelConfig the format expresses) into `directory`: config.json and
  model.safetensors, in the parameters' dtype. InputError naming a
  parameter the format lacks that is not zero."""
  checkpoint_format = FORMATS[format_name]
  values = checkpoint_format.write_keys(model)
  keys = checkpoint_format.read_keys(HfConfig('config.json', values))
  flat = traverse_util.flatten_dict(params_tree, sep='/')
  for path in checkpoint_format.absent(keys):
    if np.any(flat.pop(path)):
      raise InputError(f'--format={format_name} has no place for the '
                       f'parameter {path}, which is not zero.')
  tensors = {}
  for entry in checkpoint_format.entries(keys):
    # The readout is the language-model class's, outside the base model.
    prefix = ('' if entry.name.startswith(_HEAD)
              else checkpoint_format.prefixes[0])
    tensors[prefix + entry.name] = entry.to_tensor(flat)
    for path in entry.paths:
      del flat[path]
  if flat:
    raise InputError(f'--format={format_name} has no place for the '
                     f'parameters {sorted(flat)}.')
  values['torch_dtype'] = str(next(iter(tensors.values())).dtype)
  os.makedirs(directory, exist_ok=True)
  # PyTorch's layout, as transformers reads it in either framework.
  save_file(tensors, os.path.join(directory, 'model.safetensors'),
            metadata={'format': 'pt'})
  storage.write_whole(storage.path(directory) / 'config.json',
                      json.dumps(values, indent=2, sort_keys=True))
