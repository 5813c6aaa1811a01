"""Hugging Face's GPT-2 and Llama layouts against `decoder_lm`'s, both ways:
config.json's keys against config.model's, and each tensor of
`model.safetensors` against the parameters it holds. `pretrained.py` reads
a directory through these tables, and writes one.

A format's `model_keys` refuses, by config.json's key, what the model
cannot express; `config_values` is its inverse, for a model that the
format can express (the export checks that first, by reading its own
config.json back).
"""

from collections.abc import Callable, Mapping
import dataclasses
from typing import Any

import numpy as np

from train.base.errors import InputError


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
class Entry:
  """One tensor of a format and the parameters it holds, both ways: read
  (`to_params`) and written (`to_tensor`).

  The tensor, `shape` in the file (PyTorch's layout), transposed first if
  `transposed` (a Linear's [out, in] weight), is split into `len(paths)`
  equal parts along its last axis (GPT-2's c_attn holds the query, key and
  value projections side by side), each a parameter of `param_shape`."""

  name: str
  shape: tuple[int, ...]
  paths: tuple[str, ...]
  param_shape: tuple[int, ...]
  transposed: bool = False

  def to_params(self, array: np.ndarray) -> dict[str, np.ndarray]:
    array = array.T if self.transposed else array
    return {path: part.reshape(self.param_shape) for path, part in
            zip(self.paths, np.split(array, len(self.paths), axis=-1))}

  def to_tensor(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
    """The tensor of `params` (flat, by path)."""
    *lead, last = self.shape[::-1] if self.transposed else self.shape
    array = np.concatenate([
        np.asarray(params[path]).reshape(*lead, last // len(self.paths))
        for path in self.paths], axis=-1)
    return np.ascontiguousarray(array.T if self.transposed else array)


def _entry(name: str, shape: tuple[int, ...], path: str,
           param_shape: tuple[int, ...] | None = None,
           transposed: bool = False) -> Entry:
  """The entry of a tensor that holds one parameter (shaped as the tensor,
  transposed or not, unless `param_shape`)."""
  shape = tuple(shape)
  if param_shape is None:
    param_shape = shape[::-1] if transposed else shape
  return Entry(name, shape, (path,), tuple(param_shape), transposed)


# (config.json's key, the values the model can express, why): the first is
# what an export writes, and what a missing key means.
Fixed = tuple[str, tuple, str]


@dataclasses.dataclass(frozen=True)
class Format:
  """How one architecture's checkpoints are read and written."""

  name: str
  # config.json's model_type, and its architectures (the language-model
  # class an export names).
  model_type: str
  architecture: str
  # The preset of configs/published.py whose keys the import starts from.
  preset: str
  # Prefixes stripped from tensor names (the base model's, in checkpoints
  # of the language-model class); an export writes the first.
  prefixes: tuple[str, ...]
  # Tensors the model has no use for (buffers some versions save).
  ignored: Callable[[str], bool]
  fixed: tuple[Fixed, ...]
  # config.json -> config.model keys, and back (keys: a ModelConfig's).
  model_keys: Callable[[HfConfig], dict[str, Any]]
  config_values: Callable[[Any], dict[str, Any]]
  # config.model keys -> the tensors, in file order.
  entries: Callable[[Mapping[str, Any]], list[Entry]]
  # config.model keys -> {path: shape} of parameters the format lacks,
  # zeros in the model (none by default).
  absent: Callable[[Mapping[str, Any]], dict[str, tuple[int, ...]]] = (
      lambda keys: {})

  def read_keys(self, hf: HfConfig) -> dict[str, Any]:
    for key, allowed, why in self.fixed:
      hf.require(key, allowed, why)
    return self.model_keys(hf)

  def write_keys(self, model) -> dict[str, Any]:
    """config.json of `model` (a ModelConfig the format expresses)."""
    return dict(model_type=self.model_type, architectures=[self.architecture],
                **{key: allowed[0] for key, allowed, _ in self.fixed},
                **self.config_values(model))


def _norm(entries: list[Entry], source: str, target: str, d: int,
          bias: bool) -> None:
  entries.append(_entry(f'{source}.weight', (d,), f'{target}/scale'))
  if bias:
    entries.append(_entry(f'{source}.bias', (d,), f'{target}/bias'))


# --- GPT-2 (Radford et al. 2019) ---

def _gpt2_keys(hf: HfConfig) -> dict[str, Any]:
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
      embedding_init_stddev=hf.get('initializer_range', 0.02),
      tie_embeddings=True)


def _gpt2_values(model) -> dict[str, Any]:
  return dict(
      vocab_size=model.vocab_size, n_embd=model.d_model,
      n_layer=model.num_layers, n_head=model.num_heads,
      n_inner=model.mlp_dim, n_positions=model.max_len,
      layer_norm_epsilon=model.norm_epsilon,
      initializer_range=model.embedding_init_stddev)


def _gpt2_entries(keys: Mapping[str, Any]) -> list[Entry]:
  d, n = keys['d_model'], keys['num_heads']
  h, m = d // n, keys['mlp_dim']
  entries = [
      _entry('wte.weight', (keys['vocab_size'], d),
             'embedder/token_embedding/embedding'),
      _entry('wpe.weight', (keys['max_len'], d),
             'embedder/learned_positions/embedding')]
  for layer in range(keys['num_layers']):
    source, target = f'h.{layer}', f'decoder/block_{layer}'
    attention = f'{target}/self_attention'
    _norm(entries, f'{source}.ln_1', f'{target}/self_attention_norm', d,
          bias=True)
    # Conv1D weights are [in, out]; c_attn's outputs are q, k, v in turn.
    entries += [
        Entry(f'{source}.attn.c_attn.weight', (d, 3 * d),
              tuple(f'{attention}/{name}/kernel'
                    for name in ('query', 'key', 'value')), (d, n, h)),
        Entry(f'{source}.attn.c_attn.bias', (3 * d,),
              tuple(f'{attention}/{name}/bias'
                    for name in ('query', 'key', 'value')), (n, h)),
        _entry(f'{source}.attn.c_proj.weight', (d, d), f'{attention}/out/'
               'kernel', (n, h, d)),
        _entry(f'{source}.attn.c_proj.bias', (d,), f'{attention}/out/bias')]
    _norm(entries, f'{source}.ln_2', f'{target}/mlp_norm', d, bias=True)
    for hf_name, name, shape in (('c_fc', 'wi', (d, m)),
                                 ('c_proj', 'wo', (m, d))):
      entries += [
          _entry(f'{source}.mlp.{hf_name}.weight', shape,
                 f'{target}/mlp/{name}/kernel'),
          _entry(f'{source}.mlp.{hf_name}.bias', shape[1:],
                 f'{target}/mlp/{name}/bias')]
  _norm(entries, 'ln_f', 'decoder/final_norm', d, bias=True)
  return entries


# --- Llama (Touvron et al. 2023) ---

def _llama_keys(hf: HfConfig) -> dict[str, Any]:
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


def _llama_values(model) -> dict[str, Any]:
  return dict(
      vocab_size=model.vocab_size, hidden_size=model.d_model,
      num_hidden_layers=model.num_layers,
      num_attention_heads=model.num_heads,
      num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim,
      intermediate_size=model.mlp_dim,
      max_position_embeddings=model.max_len, rms_norm_eps=model.norm_epsilon,
      rope_theta=model.rope_max_wavelength,
      tie_word_embeddings=model.tie_embeddings,
      attention_bias=model.use_bias, mlp_bias=model.use_bias,
      initializer_range=model.embedding_init_stddev)


def _llama_entries(keys: Mapping[str, Any]) -> list[Entry]:
  d, v, m = keys['d_model'], keys['vocab_size'], keys['mlp_dim']
  n, k = keys['num_heads'], keys['num_kv_heads']
  h = keys['head_dim'] or d // n
  bias = keys['use_bias']
  entries = [_entry('embed_tokens.weight', (v, d),
                    'embedder/token_embedding/embedding')]

  def linear(source, target, outputs, inputs, out_shape, in_shape=None):
    """A Linear's [out, in] weight as a kernel [*in_shape, *out_shape]."""
    entries.append(_entry(f'{source}.weight', (outputs, inputs),
                          f'{target}/kernel',
                          (*(in_shape or (inputs,)), *out_shape),
                          transposed=True))
    if bias:
      entries.append(_entry(f'{source}.bias', (outputs,), f'{target}/bias',
                            out_shape))

  for layer in range(keys['num_layers']):
    source, target = f'layers.{layer}', f'decoder/block_{layer}'
    _norm(entries, f'{source}.input_layernorm',
          f'{target}/self_attention_norm', d, bias=False)
    attention = f'{target}/self_attention'
    linear(f'{source}.self_attn.q_proj', f'{attention}/query', n * h, d,
           (n, h))
    linear(f'{source}.self_attn.k_proj', f'{attention}/key', k * h, d, (k, h))
    linear(f'{source}.self_attn.v_proj', f'{attention}/value', k * h, d,
           (k, h))
    linear(f'{source}.self_attn.o_proj', f'{attention}/out', d, n * h, (d,),
           (n, h))
    _norm(entries, f'{source}.post_attention_layernorm',
          f'{target}/mlp_norm', d, bias=False)
    for hf_name, name, outputs, inputs in (('gate_proj', 'wi_gate', m, d),
                                           ('up_proj', 'wi', m, d),
                                           ('down_proj', 'wo', d, m)):
      linear(f'{source}.mlp.{hf_name}', f'{target}/mlp/{name}', outputs,
             inputs, (outputs,))
  _norm(entries, 'norm', 'decoder/final_norm', d, bias=False)
  if not keys['tie_embeddings']:
    entries.append(_entry('lm_head.weight', (v, d),
                          'embedder/output_projection/kernel',
                          transposed=True))
  return entries


def _llama_absent(keys: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
  # use_bias gives an untied readout a bias; Llama's lm_head has none.
  if keys['use_bias'] and not keys['tie_embeddings']:
    return {'embedder/output_projection/bias': (keys['vocab_size'],)}
  return {}


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format('hf_gpt2', model_type='gpt2', architecture='GPT2LMHeadModel',
           preset='gpt2', prefixes=('transformer.',),
           # The causal mask buffers of older checkpoints.
           ignored=lambda name: name.endswith(('.attn.bias',
                                               '.attn.masked_bias')),
           fixed=(
               ('activation_function', ('gelu_new', 'gelu_pytorch_tanh'),
                "config.model.mlp_activation='gelu' is tanh-approximated"),
               ('scale_attn_weights', (True,),
                'logits are scaled by 1/sqrt(head_dim)'),
               ('scale_attn_by_inverse_layer_idx', (False,),
                'no per-layer logit scale'),
               ('tie_word_embeddings', (True,),
                "GPT-2's readout is the embedding")),
           model_keys=_gpt2_keys, config_values=_gpt2_values,
           entries=_gpt2_entries),
    Format('hf_llama', model_type='llama', architecture='LlamaForCausalLM',
           preset='llama', prefixes=('model.',),
           ignored=lambda name: name.endswith('.rotary_emb.inv_freq'),
           fixed=(
               ('hidden_act', ('silu',),
                "config.model.mlp_activation='swiglu' gates with SiLU"),
               ('rope_scaling', (None,), 'RoPE frequencies are not '
                'rescaled'),
               ('partial_rotary_factor', (1.0, 1),
                "Llama's RoPE rotates whole heads")),
           model_keys=_llama_keys, config_values=_llama_values,
           entries=_llama_entries, absent=_llama_absent),
)}

