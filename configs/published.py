r"""Published architectures, exactly: GPT-2 (Radford et al. 2019) and Llama
(Touvron et al. 2023), and fine-tuning a checkpoint imported from either.

  python -m train.train --config=configs/published.py:gpt2 --workdir=W
  python -m train.train --config=configs/published.py:from=workdirs/gpt2 \
      --config.model.attention=local --workdir=workdirs/gpt2_local

Arguments:
  gpt2         GPT-2 small's shape (124M parameters with its 50257-token
               vocabulary): 12 pre-LayerNorm blocks of width 768, 12 heads,
               learned positions over 1024 tokens, tanh-GELU MLPs of width
               3072 with biases, LayerNorm epsilon 1e-5, the readout tied to
               embeddings drawn from N(0, 0.02) without the sqrt(d_model)
               divisor.
  llama        a small Llama-2/3 shape: 8 pre-RMSNorm blocks of width 512, 8
               query and 4 key/value heads (grouped-query), RoPE (theta
               500000) on whole heads, SwiGLU MLPs of width 1408, no biases,
               RMSNorm epsilon 1e-5, an untied readout.
  from=DIR     the config of the run in DIR (an import, or any training
               run; a path or a gs:// URL), starting from its latest
               checkpoint's parameters
               (config.init_from=DIR; DIR/checkpoints/STEP for another);
               change what you fine-tune with --config overrides, the
               attention included.

Both presets train on the config's dataset (python_stdlib_bytes: the
vocabulary holds its 258 byte ids). Their training keys are those of
nanoGPT's GPT-2 runs (AdamW at 6e-4, beta2 0.95, weight decay 0.1, cosine
to a tenth); dropout is 0.
"""

from configs import default
from train.base import storage
from train.run import init_from, portable
from train.run import workdir

# What both are: plain pre-norm decoders with dense attention and its
# projections, no experts, the readout h E^T when tied.
_DECODER = dict(
    family='decoder_lm', attention='dense', moe=dict(num_experts=0),
    norm_position='pre', attention_projections=True,
    qk_norm='none', logit_softcap=0.0, value_residual=False, smear=False,
    value_embeddings=0, unet_skips=False, memory_length=0,
    embedding_init_stddev=0.02, scale_tied_readout=False,
    dropout_rate=0.0, attention_dropout_rate=0.0)
# The architecture of each: every config.model key it sets (an import
# takes these, the checkpoint's sizes over them; head_dim is d_model /
# num_heads, and GPT-2's key/value heads its query heads).
PRESETS = {
    'gpt2': _DECODER | dict(
        vocab_size=50257, d_model=768, num_layers=12, num_heads=12,
        mlp_dim=3072, mlp_activation='gelu',
        norm='layernorm', norm_epsilon=1e-5, position='learned',
        max_len=1024, tie_embeddings=True, use_bias=True),
    'llama': _DECODER | dict(
        vocab_size=32000, d_model=512, num_layers=8, num_heads=8,
        num_kv_heads=4, mlp_dim=1408, mlp_activation='swiglu',
        norm='rmsnorm', norm_epsilon=1e-5, position='rope',
        rope_max_wavelength=500_000.0, rope_fraction=1.0, max_len=2048,
        tie_embeddings=False, use_bias=False),
}


def get_config(arg: str = 'gpt2'):
  """`arg`: a name in PRESETS, or from=DIR (see the module docstring)."""
  if arg.startswith('from='):
    return _from_run(arg[len('from='):])
  if arg not in PRESETS:
    raise ValueError(f'configs/published.py takes one of {list(PRESETS)} '
                     f'or from=DIR, got {arg!r}.')
  config = default.get_config()
  config.model.update(PRESETS[arg])
  config.dataset = 'python_stdlib_bytes'
  config.seq_len = 1024 if arg == 'gpt2' else 2048
  config.batch_size = 32
  config.learning_rate = 6e-4
  config.adam_b2 = 0.95
  config.weight_decay = 0.1
  config.warmup_steps = 100
  config.schedule = 'cosine'
  return config


def _from_run(location: str):
  """The config of the run in `location` (a workdir, or one of its
  checkpoints; a path or a URL), starting from its parameters."""
  source = storage.resolve(location)
  run, _ = init_from.run_source(source)
  if not (storage.path(run) / 'config.json').exists():
    raise ValueError(f'{run} has no config.json: from= names a training '
                     "run's workdir or one of its checkpoints "
                     '(WORKDIR/checkpoints/STEP).')
  recorded = workdir.recorded_config(run)
  if not any(key.startswith('model.') for key in recorded):
    raise ValueError(
        f"{run}/config.json is not a training run's (a Hugging Face "
        'directory is imported first: python -m '
        'experiments.import_checkpoint).')
  # Before the defaults, which hold every registered variant's options.
  recorded = portable.readable(run, recorded)
  config = default.get_config()
  config.update_from_flattened_dict({
      key: _tuples(value) for key, value in recorded.items()})
  config.init_from = source
  return config


def _tuples(value):
  """JSON's lists (the logical axis rules) as the config's tuples."""
  return tuple(map(_tuples, value)) if isinstance(value, list) else value
