r"""Training throughput of our DecoderLM against a decoder LM of the same
size written with stock Flax layers, in one run.

  python -m experiments.bench_train --out=experiments/results/bench_train \
      [--sizes=small,medium] [--batch_sizes=8,32] [--steps=10 --warmup=2] \
      [--attention=auto] [--dtype=float32] [--remat=none] [--noloop] \
      [--config=configs/published.py:gpt2] [--config.key=value ...]

Both models: learned positions, pre-LayerNorm blocks, a GELU MLP, a tied
output projection, AdamW with global-norm clipping, float32 parameters,
`--dtype` computation, synthetic rows of random tokens (one sequence a row,
causal), data parallel over every device; each size at its own batch, or
at each of --batch_sizes. Ours is `train.train`'s own step (--config:
configs/lm_stdlib.py, or configs/published.py:gpt2 for GPT-2's exact
LayerNorm epsilon, embedding scale and readout; with the size's keys and
any --config overrides; metrics included); the baseline is `nn.MultiHeadDotProductAttention` with
`nn.make_causal_mask`, written out below. For each: step time, tokens/s,
model FLOPs per token (train/program/flops.py), MFU against the device's peak (a
jitted matmul on CPU, the published bfloat16 peak of a GPU or TPU chip),
the compiled step's temporaries, and our tokens/s over the baseline's. Ours
is also timed inside `train_and_evaluate`'s loop on the config's dataset
(unless --noloop): loop_efficiency is the bare step's time over that.

Writes OUT/<backend>/results.jsonl, results.md and results.csv; without
--out, OUT is a fresh folder of workdirs/ (common.results_folder).
"""

import json
import os
import sys
import tempfile

from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np
import optax

from configs import default, lm_stdlib
from experiments import common
from train import cli
from train.base.errors import InputError
from train.base.train_config import TrainConfig
from train.program import flops
from train.run import trainer
from train.run.program import Program

FLAGS = flags.FLAGS

# name: (d_model, num_layers, num_heads, mlp_dim, seq_len, batch_size,
# vocab_size). gpt2 is GPT-2 small (Radford et al. 2019), ~124M parameters;
# the others read lm_stdlib's 258 byte tokens in the loop.
SIZES = {
    'tiny': (32, 1, 2, 64, 32, 8, 258),
    'small': (256, 4, 4, 1024, 256, 16, 258),
    'medium': (512, 6, 8, 2048, 512, 8, 258),
    'gpt2': (768, 12, 12, 3072, 1024, 8, 50304),
}


class _StockBlock(nn.Module):
  num_heads: int
  mlp_dim: int
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x, mask):
    y = nn.LayerNorm(dtype=self.dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dtype=self.dtype, deterministic=True)(
            y, y, mask=mask)
    y = nn.LayerNorm(dtype=self.dtype)(x)
    y = nn.gelu(nn.Dense(self.mlp_dim, dtype=self.dtype)(y))
    return x + nn.Dense(x.shape[-1], dtype=self.dtype)(y)


class StockLM(nn.Module):
  """A GPT-2-style decoder from stock Flax layers."""

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  mlp_dim: int
  max_len: int
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, tokens_BxT):
    embed = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype,
                     name='token_embed')
    positions = nn.Embed(self.max_len, self.d_model, dtype=self.dtype,
                         name='position_embed')
    x = embed(tokens_BxT) + positions(jnp.arange(tokens_BxT.shape[1]))[None]
    mask = nn.make_causal_mask(tokens_BxT)
    for _ in range(self.num_layers):
      x = _StockBlock(self.num_heads, self.mlp_dim, self.dtype)(x, mask)
    x = nn.LayerNorm(dtype=self.dtype)(x)
    return embed.attend(x).astype(jnp.float32)


def size_overrides(size: str, *, attention: str, dtype: str, remat: str,
                   batch_size: int | None = None) -> dict[str, object]:
  """{config key: value} that make lm_stdlib's config the GPT-2-style
  model of `size` (as StockLM builds it) on unpacked rows, `batch_size` of
  them (default: the size's)."""
  d_model, layers, heads, mlp, seq_len, batch, vocab = SIZES[size]
  batch = batch_size or batch
  model = dict(d_model=d_model, num_layers=layers, num_heads=heads,
               mlp_dim=mlp, vocab_size=vocab, max_len=seq_len,
               position='learned', norm='layernorm', norm_position='pre',
               mlp_activation='gelu', tie_embeddings=True, dropout_rate=0.0,
               qk_norm='none', zero_init_outputs=False, value_residual=False,
               smear=False, value_embeddings=0, unet_skips=False,
               logit_softcap=0.0, attention=attention, dtype=dtype,
               remat=remat)
  return dict(seq_len=seq_len, batch_size=batch, pack_sequences=False,
              optimizer='adamw', cautious_weight_decay=False,
              z_loss=0.0) | {
                  f'model.{key}': value for key, value in model.items()}


def our_config(base: ml_collections.ConfigDict, size: str, *, attention: str,
               dtype: str, remat: str, batch_size: int | None = None
               ) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(base.to_dict())
  # The base's attention options are its own attention's (make train's
  # windows by layer), which `attention` replaces.
  config.model.attention_options = default.attention_options()
  for key, value in size_overrides(size, attention=attention, dtype=dtype,
                                   remat=remat,
                                   batch_size=batch_size).items():
    *groups, name = key.split('.')
    target = config
    for group in groups:
      target = target[group]
    target[name] = value
  return config


def measure_ours(program: Program, *, steps: int, warmup: int) -> dict:
  """The program of a config, on a synthetic batch."""
  batch = program.batch(program.task.synthetic_batch(program.config))
  dropout_rng = program.key(1)
  state = program.init()
  with program.scope():
    temp_bytes = common.temp_bytes(program.train_step, state, batch,
                                   dropout_rng)
    seconds = common.time_steps(
        lambda state, batch: program.train_step(state, batch, dropout_rng),
        state, batch, steps=steps, warmup=warmup)
  return {'params': program.num_params,
          'non_embedding_params': flops.non_embedding_params(
              program.abstract_state.params),
          'step_s': seconds, 'temp_mib': temp_bytes / 2 ** 20}


def measure_loop(config) -> float:
  """Seconds a step takes in `train_and_evaluate`'s loop (reading the
  config's dataset, metrics, checkpoint checks), in a scratch workdir: the
  second of the config's two logged intervals (the first compiles and
  warms up); evaluation and a checkpoint only after the last step."""
  with tempfile.TemporaryDirectory() as workdir:
    trainer.train_and_evaluate(config, workdir)
    [_, timed] = [line for line in common.read_metrics(workdir)
                  if 'steps_per_s' in line]
  return 1 / timed['steps_per_s']


def measure_stock(config: TrainConfig, batch_sharding, *, steps: int,
                  warmup: int) -> dict:
  """The baseline, data parallel over the devices as ours is (the batch
  split as `batch_sharding` says, the rest replicated)."""
  model = StockLM(config.model.vocab_size, config.model.d_model,
                  config.model.num_layers, config.model.num_heads,
                  config.model.mlp_dim, config.seq_len,
                  jnp.dtype(config.model.dtype))
  rng = np.random.default_rng(0)
  shape = (config.batch_size, config.seq_len)
  batch = jax.device_put(
      tuple(rng.integers(1, config.model.vocab_size, shape, np.int32)
            for _ in range(2)), batch_sharding)
  params = model.init(jax.random.key(0), batch[0])['params']
  optimizer = optax.chain(
      optax.clip_by_global_norm(config.grad_clip_norm),
      optax.adamw(config.learning_rate, b1=config.adam_b1,
                  b2=config.adam_b2, eps=config.adam_eps,
                  weight_decay=config.weight_decay))

  def loss_fn(params, batch):
    inputs, targets = batch
    logits = model.apply({'params': params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets).mean()

  def train_step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  step = jax.jit(train_step, donate_argnums=0)
  state = (params, jax.jit(optimizer.init)(params))
  temp_bytes = common.temp_bytes(step, state, batch)
  seconds = common.time_steps(step, state, batch, steps=steps, warmup=warmup)
  embeddings = params['token_embed']['embedding'].size + params[
      'position_embed']['embedding'].size
  total = sum(x.size for x in jax.tree.leaves(params))
  return {'params': total, 'non_embedding_params': total - embeddings,
          'step_s': seconds, 'temp_mib': temp_bytes / 2 ** 20}


def _measure_size(base: ml_collections.ConfigDict, size: str,
                  batch_size: int, lines, *, steps: int, warmup: int,
                  attention: str, dtype: str, remat: str, loop: bool,
                  peak: float | None) -> list[dict]:
  """Our row and stock Flax's at `size` and `batch_size`, each also
  written to `lines` (results.jsonl) and printed as it is measured."""
  # Two logged intervals of `steps` for measure_loop; the bare step has
  # the same schedule, so both compile the same program.
  config = common.timed_run_config(
      our_config(base, size, attention=attention, dtype=dtype, remat=remat,
                 batch_size=batch_size),
      num_train_steps=2 * steps, log_every=steps)
  program = Program.from_config(config)
  model_config = program.model_config
  measured = {'attnlab': measure_ours(program, steps=steps, warmup=warmup),
              'stock_flax': measure_stock(
                  program.config, program.batch_sharding, steps=steps,
                  warmup=warmup)}
  rows = []
  for name, row in measured.items():
    tokens = config.batch_size * config.seq_len
    per_token = flops.train_flops_per_example(
        model_config, program.task, config.seq_len,
        row['non_embedding_params']) / config.seq_len
    row = {'size': size, 'batch': config.batch_size, 'model': name,
           'attention': (model_config.attention if name == 'attnlab' else
                         'nn.MultiHeadDotProductAttention'), **row,
           'tokens_per_s': tokens / row['step_s'],
           'model_gflop_per_token': per_token / 1e9}
    if peak:
      row['mfu'] = per_token * row['tokens_per_s'] / peak
    rows.append(row)
  ours, stock = rows
  ours['speedup_vs_stock'] = ours['tokens_per_s'] / stock['tokens_per_s']
  if loop:
    ours['loop_step_s'] = measure_loop(config)
    ours['loop_efficiency'] = ours['step_s'] / ours['loop_step_s']
  for row in rows:
    lines.write(json.dumps(row) + '\n')
    print(json.dumps(row), flush=True)
  return rows


def run(base: ml_collections.ConfigDict, out: str, *, sizes: list[str],
        steps: int, warmup: int, attention: str, dtype: str, remat: str,
        batch_sizes: list[int] = (), loop: bool = True,
        command: str = '') -> list[dict]:
  """The two models at each size (and each of `batch_sizes`, if given);
  writes OUT/<backend>/results.{jsonl,md,csv} and returns the rows."""
  for size in sizes:
    if size not in SIZES:
      raise InputError(f'--sizes: unknown size {size!r}; known: '
                       f'{", ".join(SIZES)}.')
  if steps < 1 or warmup < 1:
    raise InputError(f'--steps={steps} and --warmup={warmup} must be at '
                     'least 1 (the first warmup step compiles).')
  directory = os.path.join(out, jax.default_backend())
  os.makedirs(directory, exist_ok=True)
  peak = flops.peak_flops_per_device()
  rows = []
  with open(os.path.join(directory, 'results.jsonl'), 'w') as lines:
    for size in sizes:
      for batch_size in batch_sizes or [SIZES[size][5]]:
        rows += _measure_size(base, size, batch_size, lines, steps=steps,
                              warmup=warmup, attention=attention,
                              dtype=dtype, remat=remat, loop=loop,
                              peak=peak)
  columns = ['size', 'batch', 'model', 'attention', 'params', 'step_s',
             'tokens_per_s', 'speedup_vs_stock', 'model_gflop_per_token',
             'mfu', 'temp_mib', 'loop_step_s', 'loop_efficiency']
  shapes = '; '.join(
      f'{size}: d_model {SIZES[size][0]}, {SIZES[size][1]} layers, '
      f'{SIZES[size][2]} heads, MLP {SIZES[size][3]}, T {SIZES[size][4]}, '
      f'batch {SIZES[size][5]}, vocabulary {SIZES[size][6]}'
      for size in sizes) + (
          f' (batch: {", ".join(map(str, batch_sizes))} rows instead)'
          if batch_sizes else '')
  preamble = (
      '# Training throughput: attnlab DecoderLM against stock Flax\n\n'
      + (f'Command: `{command}`\n\n' if command else '')
      + f'Machine: {common.machine_description()}; peak '
      f'{peak / 1e9 if peak else float("nan"):.0f} GFLOP/s '
      '(train/program/flops.py).\n\n'
      f'Sizes: {shapes}. {dtype} computation, float32 parameters, '
      f'remat {remat}; {steps} timed steps after {warmup}. MFU counts the '
      'model FLOPs of train/program/flops.py (6 N + 6 L T d + 6 d V per '
      'token). '
      'temp_mib: the compiled step\'s temporaries (XLA memory analysis). '
      'loop_efficiency: the bare step time over the time of a step in '
      '`train_and_evaluate`\'s loop on the config\'s dataset.\n\n')
  print(common.write_table(rows, columns, os.path.join(directory, 'results'),
                           preamble))
  return rows


def main(argv: list[str]) -> None:
  common.results_main(argv, 'bench_train', lambda out: run(
      FLAGS.config, out, sizes=FLAGS.sizes, steps=FLAGS.steps,
      warmup=FLAGS.warmup, attention=FLAGS.attention, dtype=FLAGS.dtype,
      remat=FLAGS.remat,
      batch_sizes=common.parse_integers('--batch_sizes', FLAGS.batch_sizes),
      loop=FLAGS.loop,
      command='python -m experiments.bench_train ' + ' '.join(sys.argv[1:])))


def _define_flags() -> None:
  """The command line, defined only when this runs as a script."""
  config_flags.DEFINE_config_file(
      'config', lm_stdlib.__file__, 'Training config file of ours '
      '(optimizer and the rest; e.g. configs/published.py:gpt2 for GPT-2\'s '
      'exact architecture); sizes override its shape and what StockLM '
      'builds.', lock_config=True)
  common.define_out_flag('bench_train')
  flags.DEFINE_list('sizes', ['small', 'medium'],
                    f'Model sizes, of {", ".join(SIZES)}.')
  flags.DEFINE_list('batch_sizes', [], 'Rows a step, each measured; '
                    'default: each size\'s own.')
  flags.DEFINE_integer('steps', 10, 'Timed steps.')
  flags.DEFINE_integer('warmup', 2, 'Untimed steps first (compiling).')
  flags.DEFINE_string('attention', 'auto', 'Our config.model.attention.')
  flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'],
                    'Computation dtype of both models.')
  flags.DEFINE_enum('remat', 'none', ['none', 'full', 'dots_saveable'],
                    'Our config.model.remat.')
  flags.DEFINE_bool('loop', True, 'Also time our step in the training loop '
                    '(loop_efficiency).')


if __name__ == '__main__':
  cli.run(main, _define_flags)
