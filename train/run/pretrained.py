"""Published checkpoints read from disk: a Hugging Face model directory
(`config.json` and `*.safetensors`, as PyTorch or Flax wrote them) mapped
onto `decoder_lm`'s parameter tree, by format.

FORMATS names what `experiments.import_checkpoint --format` reads: each turns
config.json into `config.model` keys (refusing, by its key, what the model
cannot express) and the tensors into parameters, each tensor's shape
checked against those keys. Tokenizers are not read: an imported model
reads the token ids of its run's dataset (see experiments/import_checkpoint.py).
"""

from collections.abc import Callable, Mapping
import dataclasses
import glob
import json
import os
from typing import Any

# Importing flax imports jax, which makes bfloat16 (most Llama checkpoints'
# dtype) a numpy dtype that safetensors reads.
from flax import traverse_util
import numpy as np
from safetensors.numpy import load_file

from train.base.errors import InputError


class Tensors:
  """A checkpoint's tensors by canonical name, in PyTorch's layout: `.weight`
  for every matrix, vector and table (a Linear's [out, in], GPT-2's Conv1D
  [in, out]), `.bias` for biases. Flax's files name a matrix `.kernel` in
  the transposed layout, a table `.embedding` and a norm's gain `.scale`:
  they are renamed (and matrices transposed) as they are read.

  `take(name, shape)` hands out a tensor once, checking its shape; `drop`
  leaves one unread; `done()` refuses tensors left over that no parameter
  read."""

  def __init__(self, directory: str, prefixes: tuple[str, ...],
               ignored: Callable[[str], bool]):
    self.directory = directory
    files = sorted(glob.glob(os.path.join(directory, '*.safetensors')))
    if not files:
      raise InputError(f'--from={directory} holds no *.safetensors file: '
                       'save the model with safe_serialization=True.')
    self._tensors, self._file_names = {}, {}
    for path in files:
      try:
        named = load_file(path)
      except Exception as error:  # safetensors' errors have several types.
        raise InputError(f'{path} is not a readable safetensors file: '
                         f'{str(error).splitlines()[0][:200]}') from None
      for file_name, array in named.items():
        name = _canonical_name(file_name, prefixes)
        if name.endswith('.kernel'):
          name, array = name[:-len('kernel')] + 'weight', array.T
        if name in self._tensors:
          raise InputError(f'--from={directory}: the tensor {name} is in '
                           'more than one file.')
        if not ignored(name):
          self._tensors[name] = np.asarray(array)
          self._file_names[name] = file_name

  def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor `name` (float32), which must have `shape`."""
    if name not in self._tensors:
      raise InputError(f'--from={self.directory} has no tensor {name}, which '
                       'its config.json implies.')
    array = self._tensors.pop(name)
    if array.shape != tuple(shape):
      raise InputError(
          f'--from={self.directory}: {name} has shape {list(array.shape)}; '
          f'its config.json gives {list(shape)}.')
    return array.astype(np.float32)

  def drop(self, name: str) -> str | None:
    """Removes the tensor `name` unread; the name its file gives it, or
    None where it has none."""
    if self._tensors.pop(name, None) is None:
      return None
    return self._file_names[name]

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


class HfConfig:
  """config.json's values, each read once by its key; a refusal names the
  key and the file."""

  def __init__(self, path: str, values: Mapping[str, Any]):
    self.path, self.values = path, values

  def get(self, key: str, default: Any = None) -> Any:
    value = self.values.get(key)
    return default if value is None else value

  def need(self, key: str) -> Any:
    """The value of `key`, which the architecture cannot do without."""
    value = self.values.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise InputError(f'{self.path}: {key}={value!r} must be a positive '
                       'integer (a size of the architecture).')
    return value

  def require(self, key: str, allowed, why: str) -> None:
    """Refuses a value of `key` outside `allowed` (a value missing counts
    as the first allowed one)."""
    value = self.values.get(key, allowed[0])
    if value not in allowed:
      raise InputError(f'{self.path}: {key}={value!r} is not supported '
                       f'({why}); supported: {list(allowed)}.')


@dataclasses.dataclass(frozen=True)
class Format:
  """How one architecture's checkpoints are read."""

  name: str
  # config.json's model_type.
  model_type: str
  # The preset of configs/published.py whose keys the import starts from.
  preset: str
  # Prefixes stripped from tensor names (the base model's, in checkpoints
  # of the language-model class).
  prefixes: tuple[str, ...]
  # Tensors the model has no use for (buffers some versions save).
  ignored: Callable[[str], bool]
  # config.json -> config.model keys.
  model_keys: Callable[[HfConfig], dict[str, Any]]
  # (tensors, config.model keys) -> the parameter tree (inside 'params').
  params: Callable[[Tensors, Mapping[str, Any]], dict]


def _tied_head(tensors: Tensors) -> None:
  """A tied checkpoint reads out through its embedding, as transformers
  reads it: a head beside it (Flax's save_pretrained writes one, unused)
  is left unread, with a line saying so."""
  unread = tensors.drop('lm_head.weight')
  if unread:
    print(f'--from={tensors.directory}: {unread} is not read: its '
          'config.json ties the readout to the embedding '
          '(tie_word_embeddings), as transformers reads it.', flush=True)


def _gpt2_keys(hf: HfConfig) -> dict[str, Any]:
  hf.require('activation_function', ('gelu_new', 'gelu_pytorch_tanh'),
             "config.model.mlp_activation='gelu' is tanh-approximated")
  hf.require('scale_attn_weights', (True,), 'logits are scaled by '
             '1/sqrt(head_dim)')
  hf.require('scale_attn_by_inverse_layer_idx', (False,),
             'no per-layer logit scale')
  hf.require('tie_word_embeddings', (True,), "GPT-2's readout is the "
             'embedding')
  d_model, num_heads = hf.need('n_embd'), hf.need('n_head')
  if d_model % num_heads:
    raise InputError(f'{hf.path}: n_head={num_heads} does not divide '
                     f'n_embd={d_model}.')
  return dict(
      vocab_size=hf.need('vocab_size'), d_model=d_model,
      num_layers=hf.need('n_layer'), num_heads=num_heads,
      # As many key/value heads, of d_model / num_heads (ModelConfig's
      # defaults, so that the preset's config resumes the import).
      num_kv_heads=None, head_dim=None,
      mlp_dim=hf.get('n_inner', 4 * d_model),
      max_len=hf.need('n_positions'),
      norm_epsilon=hf.get('layer_norm_epsilon', 1e-5),
      embedding_init_stddev=hf.get('initializer_range', 0.02))


def _gpt2_params(tensors: Tensors, keys: Mapping[str, Any]) -> dict:
  d, n = keys['d_model'], keys['num_heads']
  h, m = d // n, keys['mlp_dim']
  flat = {}
  put = flat.__setitem__
  put('embedder/token_embedding/embedding',
      tensors.take('wte.weight', (keys['vocab_size'], d)))
  put('embedder/learned_positions/embedding',
      tensors.take('wpe.weight', (keys['max_len'], d)))

  def norm(source, target):
    put(f'{target}/scale', tensors.take(f'{source}.weight', (d,)))
    put(f'{target}/bias', tensors.take(f'{source}.bias', (d,)))

  for layer in range(keys['num_layers']):
    source, target = f'h.{layer}', f'decoder/block_{layer}'
    norm(f'{source}.ln_1', f'{target}/self_attention_norm')
    norm(f'{source}.ln_2', f'{target}/mlp_norm')
    # Conv1D weights are [in, out]; c_attn's outputs are q, k, v in turn.
    qkv = tensors.take(f'{source}.attn.c_attn.weight', (d, 3 * d))
    qkv_bias = tensors.take(f'{source}.attn.c_attn.bias', (3 * d,))
    for index, name in enumerate(('query', 'key', 'value')):
      columns = slice(index * d, (index + 1) * d)
      put(f'{target}/self_attention/{name}/kernel',
          qkv[:, columns].reshape(d, n, h))
      put(f'{target}/self_attention/{name}/bias',
          qkv_bias[columns].reshape(n, h))
    put(f'{target}/self_attention/out/kernel', tensors.take(
        f'{source}.attn.c_proj.weight', (d, d)).reshape(n, h, d))
    put(f'{target}/self_attention/out/bias',
        tensors.take(f'{source}.attn.c_proj.bias', (d,)))
    for hf_name, name, shape in (('c_fc', 'wi', (d, m)),
                                 ('c_proj', 'wo', (m, d))):
      put(f'{target}/mlp/{name}/kernel',
          tensors.take(f'{source}.mlp.{hf_name}.weight', shape))
      put(f'{target}/mlp/{name}/bias',
          tensors.take(f'{source}.mlp.{hf_name}.bias', (shape[1],)))
  norm('ln_f', 'decoder/final_norm')
  _tied_head(tensors)
  return traverse_util.unflatten_dict(flat, sep='/')


def _llama_keys(hf: HfConfig) -> dict[str, Any]:
  hf.require('hidden_act', ('silu',), "config.model.mlp_activation='swiglu' "
             'gates with SiLU')
  hf.require('rope_scaling', (None,), 'RoPE frequencies are not rescaled')
  hf.require('partial_rotary_factor', (1.0, 1), "Llama's RoPE rotates "
             'whole heads')
  # transformers 5 writes RoPE's settings in one mapping.
  rope = hf.get('rope_parameters', {})
  if rope.get('partial_rotary_factor', 1) != 1:
    raise InputError(f'{hf.path}: rope_parameters.partial_rotary_factor='
                     f"{rope['partial_rotary_factor']!r} is not supported "
                     "(Llama's RoPE rotates whole heads).")
  if rope.get('rope_type', 'default') != 'default':
    raise InputError(f'{hf.path}: rope_parameters.rope_type='
                     f"{rope['rope_type']!r} is not supported (RoPE "
                     "frequencies are not rescaled); supported: ['default'].")
  if bool(hf.get('mlp_bias', False)) != bool(hf.get('attention_bias', False)):
    raise InputError(
        f'{hf.path}: attention_bias={hf.get("attention_bias", False)!r} and '
        f'mlp_bias={hf.get("mlp_bias", False)!r} differ; '
        'config.model.use_bias sets both.')
  d_model, num_heads = hf.need('hidden_size'), hf.need('num_attention_heads')
  head_dim = hf.get('head_dim', d_model // num_heads)
  if head_dim == d_model // num_heads and not d_model % num_heads:
    head_dim = None  # ModelConfig's default, as the preset leaves it.
  return dict(
      vocab_size=hf.need('vocab_size'), d_model=d_model,
      num_layers=hf.need('num_hidden_layers'), num_heads=num_heads,
      num_kv_heads=hf.get('num_key_value_heads', num_heads),
      head_dim=head_dim, mlp_dim=hf.need('intermediate_size'),
      max_len=hf.get('max_position_embeddings', 2048),
      norm_epsilon=hf.get('rms_norm_eps', 1e-6),
      rope_max_wavelength=float(rope.get('rope_theta',
                                         hf.get('rope_theta', 10_000.0))),
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
      use_bias=bool(hf.get('attention_bias', False)),
      embedding_init_stddev=hf.get('initializer_range', 0.02))


def _llama_params(tensors: Tensors, keys: Mapping[str, Any]) -> dict:
  d, v, m = keys['d_model'], keys['vocab_size'], keys['mlp_dim']
  n, k = keys['num_heads'], keys['num_kv_heads']
  h = keys['head_dim'] or d // n
  bias = keys['use_bias']
  flat = {}
  put = flat.__setitem__
  put('embedder/token_embedding/embedding',
      tensors.take('embed_tokens.weight', (v, d)))
  if not keys['tie_embeddings']:
    put('embedder/output_projection/kernel',
        tensors.take('lm_head.weight', (v, d)).T)
    if bias:  # use_bias gives the readout one; Llama's has none.
      put('embedder/output_projection/bias', np.zeros(v, np.float32))

  def linear(source, target, outputs, inputs, out_shape, in_shape=None):
    """A Linear's [out, in] weight as a kernel [*in_shape, *out_shape]."""
    weight = tensors.take(f'{source}.weight', (outputs, inputs)).T
    put(f'{target}/kernel', weight.reshape(*(in_shape or (inputs,)),
                                           *out_shape))
    if bias:
      put(f'{target}/bias', tensors.take(f'{source}.bias',
                                         (outputs,)).reshape(out_shape))

  for layer in range(keys['num_layers']):
    source, target = f'layers.{layer}', f'decoder/block_{layer}'
    put(f'{target}/self_attention_norm/scale',
        tensors.take(f'{source}.input_layernorm.weight', (d,)))
    put(f'{target}/mlp_norm/scale',
        tensors.take(f'{source}.post_attention_layernorm.weight', (d,)))
    attention = f'{target}/self_attention'
    linear(f'{source}.self_attn.q_proj', f'{attention}/query', n * h, d,
           (n, h))
    linear(f'{source}.self_attn.k_proj', f'{attention}/key', k * h, d, (k, h))
    linear(f'{source}.self_attn.v_proj', f'{attention}/value', k * h, d,
           (k, h))
    linear(f'{source}.self_attn.o_proj', f'{attention}/out', d, n * h, (d,),
           (n, h))
    for hf_name, name, outputs, inputs in (('gate_proj', 'wi_gate', m, d),
                                           ('up_proj', 'wi', m, d),
                                           ('down_proj', 'wo', d, m)):
      linear(f'{source}.mlp.{hf_name}', f'{target}/mlp/{name}', outputs,
             inputs, (outputs,))
  put('decoder/final_norm/scale', tensors.take('norm.weight', (d,)))
  if keys['tie_embeddings']:
    _tied_head(tensors)
  return traverse_util.unflatten_dict(flat, sep='/')


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format('hf_gpt2', model_type='gpt2', preset='gpt2',
           prefixes=('transformer.',),
           # The causal mask buffers of older checkpoints.
           ignored=lambda name: name.endswith(('.attn.bias',
                                               '.attn.masked_bias')),
           model_keys=_gpt2_keys, params=_gpt2_params),
    Format('hf_llama', model_type='llama', preset='llama',
           prefixes=('model.',),
           ignored=lambda name: name.endswith('.rotary_emb.inv_freq'),
           model_keys=_llama_keys, params=_llama_params),
)}


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
  return checkpoint_format.model_keys(HfConfig(path, values))


def params(directory: str, format_name: str, keys: Mapping[str, Any]
           ) -> dict:
  """The parameter tree of the checkpoint in `directory` (`keys`: its
  `model_keys`, a valid model config); InputError naming a tensor that is
  missing, of another shape or left over."""
  checkpoint_format = FORMATS[format_name]
  tensors = Tensors(directory, checkpoint_format.prefixes,
                    checkpoint_format.ignored)
  tree = checkpoint_format.params(tensors, keys)
  tensors.done()
  return tree
