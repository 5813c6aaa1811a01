r"""Attention speed and memory against sequence length: every registered
variant and XLA's `jax.nn.dot_product_attention` ('xla'), on whatever
backend runs this, over plain, packed or padded rows, rows under ALiBi's
or T5's bias, or capped logits.

  python -m experiments.bench_attention \
      --out=experiments/results/bench_attention \
      [--lengths=1024,2048,4096,8192,16384,32768,65536] [--variants=xla,...] \
      [--rows=plain,packed,padded,alibi,t5,capped] \
      [--causal=True --batch=1 --heads=8 --head_dim=64 --dtype=float32] \
      [--options=local.window=256,...] [--reps=3] [--max_seconds=60]

A variant that takes a fused kernel (model/attention/kernels/fused.py) is named
with it in brackets, `chunked[cudnn]`, `local[pallas_tpu]`, and measured by
that kernel alone; plain `chunked` is its 'auto' choice. By default every
registered variant is measured, and on a GPU also chunked[xla] (the JAX
code), chunked[cudnn] and chunked[pallas_gpu], on a TPU chunked[xla] and
chunked[pallas_tpu] (on CPU the Pallas kernels run interpreted, which
measures nothing of their speed: name them to run them).

--rows picks the masks: 'plain' rows, none; 'packed' rows, documents of
about 2T/7 positions each (their ends inside any power-of-two block), as a
SegmentMask, and for xla the [B, 1, T, S] mask their ids compare to;
'padded' rows, whose first 3T/4 + 1 keys are real and the rest right
padding (its start inside any block), as a key padding mask [B, 1, 1, S],
and for xla each row's number of keys; 'alibi' rows, no mask and ALiBi's
bias -slope_n |i - j|, 't5' rows T5's learned bias (causal buckets, a
table drawn once), each as a score function computed by blocks (on a
Pallas kernel, inside its tiles), and for xla the [B, N, T, S] array it
stands for; 'capped' rows, no mask and the logits capped at 30 (the
`logit_cap` option of the variants that take it; xla uncapped, a time
reference only). A window per layer is measured as `local` at each of
its windows (--options=local.window=W, one run each).

For each rows kind, variant and length: the compiled temporary memory of
the forward pass and of forward+backward (`memory_analysis()` of the
compiled program), and the best time of each over a first run and --reps
more (fewer once the runs have taken 20 s). A size whose compiled memory
(arguments, outputs and temporaries) would not fit the device, that ran out
of device memory while compiling (XLA's autotuner can) or running, with
what it needed, or that follows one that did not fit or took longer than
--max_seconds, is skipped with the reason, and the sweep goes on; so is a
variant that cannot run the case (a non-causal one when --causal, `ring`,
which needs a mesh with a sequence axis, one taking key padding masks only
on packed rows, one taking no bias on alibi rows, a kernel that refuses
the case: `fused.KernelError`). Every variant gets its speed in exact
attention's FLOP/s (the dense equivalent: matmuls only, causal half
counted, the same on packed and padded rows as on plain ones; the backward
pass 2.5 times the forward) and that rate's fraction of the device's peak
(train/program/flops.py; on CPU a matmul measured in the same run); and
its own work, own_gflop (forward+backward: exact attention's for the exact
variants, else the matmuls of its gradient program, counted from the
jaxpr: a kernelised variant's features and states, a block-sparse one's
blocks; on a Pallas kernel, the tiles that kernel visits), with that
rate's fraction of peak, own_fraction_of_peak: an efficient variant that
does little work slowly shows there, where its dense-equivalent rate looks
good. Any other variant run by a fused kernel or a while loop has no own
count.

Writes OUT/<backend>/results.jsonl (a line per rows kind, variant and
length), results.md and .csv (forward+backward time, its ratio to xla on
the same kind of rows and length, temporary memory and its ratio to xla's,
a row per kind, variant and length) and scaling.png (log-log); without
--out, OUT is a fresh folder of workdirs/ (common.results_folder): the
committed results change only when --out names them.
"""

from collections.abc import Sequence
import itertools
import json
import os
import re
import sys
import time

from absl import flags
import jax
import jax.numpy as jnp

from experiments import attention_cases, common
from model.attention.kernels import flex, flex_gpu, fused, fused_kernels
from train import cli
from train.base.errors import InputError
from train.program import device_memory, flops

FLAGS = flags.FLAGS

def _best_time(compiled, args, reps: int, budget_s: float = 20.0) -> float:
  """The best of a first run and up to `reps` more, the more ones stopping
  once the runs have taken `budget_s` (a minute-long run needs no
  repeating)."""
  times = []
  while len(times) <= reps and sum(times) < budget_s:
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return min(times)


def _compile(program, args):
  return program.lower(*args).compile()


def _out_of_memory(error: Exception) -> str | None:
  """What an XLA out-of-memory error says was needed ('' if it does not
  say); None for any other error."""
  text = str(error)
  if 'RESOURCE_EXHAUSTED' not in text:
    return None
  gib = re.search(r'([\d.]+)\s*GiB', text)
  if gib:
    return f'{float(gib.group(1)):.1f} GiB'
  count = re.search(r'(\d+) bytes', text)
  return f'{int(count.group(1)) / 2**30:.1f} GiB' if count else ''


def _did_not_fit(key: str, doing: str, error: Exception) -> dict:
  """The skip of a program that ran out of memory; re-raises `error` if it
  is something else."""
  needed = _out_of_memory(error)
  if needed is None:
    raise error
  return {'skipped': f'{key} ran out of device memory {doing}'
                     + (f' (needed {needed})' if needed else ''),
          'did_not_fit': True}


def attention_flops(length: int, *, batch: int, heads: int, head_dim: int,
                    causal: bool, backward: bool) -> float:
  """Matmul FLOPs of exact attention: 4 B N T^2 H forward (q k^T and the
  weighted sum), half of it causal; the backward pass 2.5 times that."""
  forward = 4 * batch * heads * length**2 * head_dim * (0.5 if causal else 1)
  return forward * (3.5 if backward else 1.0)


def recorded_kernels(fn, args) -> list[fused.Decision]:
  """The fused kernels' choices of fn(*args), from a trace of its own: a
  cached trace records nothing, and jit(fn) must not reuse a trace made
  while recording (where every call runs xla)."""
  with fused.recording() as decisions:
    jax.eval_shape(lambda *args: fn(*args), *args)
  return decisions


def tile_flops(decisions: list[fused.Decision], *, batch: int, heads: int,
               head_dim: int) -> float | None:
  """Forward+backward matmul FLOPs of the tiles that the Pallas kernels
  visit for block-sparse patterns and windows, from the choices a trace
  recorded (`fused.recording()`): 4 tile^2 H per visited tile and query
  head forward, the backward 2.5 times that. None unless every call ran
  one of them."""
  total = 0.0
  for decision in decisions:
    case = decision.case
    pattern = case.seen
    if pattern is None or decision.kernel not in ('pallas_tpu', 'pallas_gpu'):
      return None
    if decision.kernel == 'pallas_tpu':
      padded, tile = fused_kernels.splash_tiles(case.q_len, case.pattern)
    else:
      tile = flex_gpu.tile_size(pattern, case.q_len)
      padded = -(-case.q_len // tile) * tile
    tiles = flex.touched_tiles(pattern, padded, tile, case.is_causal).sum()
    total += 4.0 * tiles * tile**2 * head_dim * batch * heads
  return total * 3.5 if decisions else None


def measure(name: str, kind: str, length: int, *, options: dict,
            causal: bool, batch: int, heads: int, head_dim: int, dtype,
            reps: int, memory_limit: int) -> dict:
  """One line of results.jsonl: variant `name` on `kind` rows."""
  row = {'variant': name, 'rows': kind, 'length': length}
  shape = (batch, length, heads, head_dim)
  q, k, v = (jax.random.normal(key, shape, dtype)
             for key in jax.random.split(jax.random.key(1), 3))
  mask = attention_cases.rows_mask(kind, batch, length)
  bias = attention_cases.rows_bias(kind, batch, length, heads)
  try:
    made = attention_cases.variant_fn(
        name, kind, length, options, causal=causal, heads=heads,
        head_dim=head_dim, q=q, mask=mask, bias=bias)
  except fused.KernelError as error:
    return row | {'skipped': f'{name}: {error}'}
  if isinstance(made, str):
    return row | {'skipped': made}
  fn, params = made
  loss = lambda params, q, k, v, mask, bias: jnp.sum(
      fn(params, q, k, v, mask, bias).astype(jnp.float32))
  programs = {'fwd': jax.jit(fn),
              'fwd_bwd': jax.jit(jax.grad(loss, argnums=(1, 2, 3)))}
  args = (params, q, k, v, mask, bias)
  exact = attention_cases.parse_variant(name)[0] in attention_cases.EXACT
  compiled = {}
  for key, program in programs.items():
    # XLA's autotuner can run out of memory compiling, as a run can.
    try:
      compiled[key] = _compile(program, args)
    except jax.errors.JaxRuntimeError as error:
      return row | _did_not_fit(key, 'compiling', error)
    memory = compiled[key].memory_analysis()
    total = device_memory.needed_bytes(memory)
    row[f'{key}_temp_mb'] = memory.temp_size_in_bytes / 2**20
    if total > memory_limit:
      return row | {'skipped': f'{key} needs {total / 2**30:.1f} GiB, more '
                               f'than the {memory_limit / 2**30:.1f} GiB the '
                               'device holds', 'did_not_fit': True}
  for key in programs:
    try:
      row[f'{key}_s'] = _best_time(compiled[key], args, reps)
    except jax.errors.JaxRuntimeError as error:
      return row | _did_not_fit(key, 'running', error)
    row[f'{key}_gflop_per_s'] = attention_flops(
        length, batch=batch, heads=heads, head_dim=head_dim, causal=causal,
        backward=key == 'fwd_bwd') / row[f'{key}_s'] / 1e9
  # The variant's own work: exact attention's, or the matmuls it runs, or
  # the tiles its Pallas kernel visits.
  own = (attention_flops(length, batch=batch, heads=heads,
                         head_dim=head_dim, causal=causal, backward=True)
         if exact else flops.matmul_flops(
             jax.make_jaxpr(programs['fwd_bwd'])(*args).jaxpr))
  if own is None:
    own = tile_flops(recorded_kernels(fn, args), batch=batch, heads=heads,
                     head_dim=head_dim)
  if own is not None:
    row['own_gflop'] = own / 1e9
    row['own_gflop_per_s'] = own / row['fwd_bwd_s'] / 1e9
  return row


def run(out: str, *, variants: list[str], lengths: list[int],
        options: dict[str, dict], causal: bool, batch: int, heads: int,
        head_dim: int, dtype: str, reps: int, max_seconds: float,
        rows: Sequence[str] = ('plain',), memory_limit_mb: float = 0.0,
        command: str = '') -> list[dict]:
  """Measures every variant at every length on each kind of `rows`;
  writes the results."""
  for name in variants:
    attention_cases.parse_variant(name)
  common.check_options(options)
  for kind in rows:
    if kind not in attention_cases.ROWS:
      raise InputError(f'--rows: unknown kind {kind!r}; one of '
                       f'{", ".join(attention_cases.ROWS)}.')
  for name, value in (('reps', reps), ('batch', batch), ('heads', heads),
                      ('head_dim', head_dim)):
    if value < 1:
      raise InputError(f'--{name}={value} must be at least 1.')
  directory = os.path.join(out, jax.default_backend())
  os.makedirs(directory, exist_ok=True)
  # On CPU 85% of the machine: the rest is the system's and this process's.
  memory_limit = (memory_limit_mb * 2**20 if memory_limit_mb
                  else device_memory.held_bytes(host_share=0.85))
  peak = flops.peak_flops_per_device()
  results = []
  with open(os.path.join(directory, 'results.jsonl'), 'w') as lines:
    for kind, name in itertools.product(rows, variants):
      # Why longer lengths are not tried: too slow, or too large (whose
      # shapes can outgrow what XLA indexes).
      given_up = None
      for length in sorted(lengths):
        if given_up:
          row = {'variant': name, 'rows': kind, 'length': length,
                 'skipped': given_up}
        else:
          row = measure(name, kind, length, options=options, causal=causal,
                        batch=batch, heads=heads, head_dim=head_dim,
                        dtype=jnp.dtype(dtype), reps=reps,
                        memory_limit=memory_limit)
          if row.get('fwd_bwd_s', 0) > max_seconds:
            given_up = (f'{name} took {row["fwd_bwd_s"]:.0f} s at length '
                        f'{length}, over --max_seconds={max_seconds:g}')
          elif row.pop('did_not_fit', False):
            given_up = f'{name} did not fit at length {length}'
        if 'fwd_bwd_gflop_per_s' in row and peak:
          row['fraction_of_peak'] = row['fwd_bwd_gflop_per_s'] / (peak / 1e9)
        if 'own_gflop_per_s' in row and peak:
          row['own_fraction_of_peak'] = row['own_gflop_per_s'] / (peak / 1e9)
        results.append(row)
        lines.write(json.dumps(row) + '\n')
        lines.flush()
        print(json.dumps(row), flush=True)
  _write_summary(results, directory, peak, command=command, causal=causal,
                 shape=f'B={batch}, N={heads}, H={head_dim}, {dtype}')
  return results


def _write_summary(rows: list[dict], directory: str, peak: float | None, *,
                   command: str, causal: bool, shape: str) -> None:
  """results.md/.csv: a row per rows kind, variant and length with the
  ratios to xla on that kind of rows at that length; scaling.png."""
  xla = {(row['rows'], row['length']): row for row in rows
         if row['variant'] == 'xla' and 'fwd_bwd_s' in row}
  table = []
  for row in rows:
    line = dict(row)
    reference = xla.get((row['rows'], row['length']))
    if reference and 'fwd_bwd_s' in row:
      line['speedup_vs_xla'] = reference['fwd_bwd_s'] / row['fwd_bwd_s']
      line['memory_vs_xla'] = (row['fwd_bwd_temp_mb']
                               / max(reference['fwd_bwd_temp_mb'], 1e-9))
    table.append(line)
  columns = ['rows', 'variant', 'length', 'fwd_s', 'fwd_bwd_s',
             'speedup_vs_xla', 'fwd_bwd_temp_mb', 'memory_vs_xla',
             'fwd_bwd_gflop_per_s', 'fraction_of_peak', 'own_gflop',
             'own_fraction_of_peak', 'skipped']
  preamble = (
      f'# Attention speed and memory, {"causal" if causal else "bidirectional"}'
      f', {shape}\n\n'
      + (f'Command: `{command}`\n\n' if command else '')
      + f'Machine: {common.machine_description()}; peak '
      f'{peak / 1e9 if peak else float("nan"):.0f} GFLOP/s '
      '(train/program/flops.py: the published bfloat16 peak of a GPU or TPU '
      'chip, a jitted 2048x2048 float32 matmul on CPU).\n\n'
      'Times are the best of the repetitions, forward+backward is the '
      'gradient with respect to q, k and v; memory is the compiled '
      'temporaries of forward+backward; ratios are to xla '
      '(`jax.nn.dot_product_attention`) on the same rows at the same '
      'length in this run (speedup > 1: faster). Rows: plain (no mask), '
      'packed (documents of about 2T/7 positions, as segment ids), '
      'padded (the first 3T/4 + 1 keys real, the rest right padding), '
      "alibi or t5 (no mask, ALiBi's or T5's position bias) or capped (no "
      'mask, logits capped at 30; xla uncapped). fwd_bwd_gflop_per_s and '
      "fraction_of_peak: exact attention's FLOPs over the time (the dense "
      'equivalent, whatever the variant computes); own_gflop: the '
      "variant's own forward+backward matmul GFLOP (exact attention's, or "
      'counted from its gradient program), own_fraction_of_peak: their '
      'rate over the peak.\n\n')
  table_md = common.write_table(table, columns,
                                os.path.join(directory, 'results'), preamble)
  kinds = set(row['rows'] for row in rows)
  # A series per variant; per variant and kind where there are several.
  series = lambda row: (row['variant'] if len(kinds) == 1
                        else f'{row["variant"]}, {row["rows"]}')
  names = list(dict.fromkeys(map(series, rows)))
  common.plot_against_length(
      [(label, {name: [(row['length'], row.get(key)) for row in rows
                       if series(row) == name] for name in names})
       for key, label in (('fwd_bwd_s', 'forward+backward (s)'),
                          ('fwd_bwd_temp_mb',
                           'compiled temporary memory (MiB)'))],
      os.path.join(directory, 'scaling.png'))
  print(table_md)


def main(argv: list[str]) -> None:
  common.results_main(argv, 'bench_attention', lambda out: run(
      out,
      variants=FLAGS.variants or attention_cases.default_variants(
          jax.default_backend()),
      lengths=common.parse_integers('--lengths', FLAGS.lengths),
      options=common.parse_options(FLAGS.options), causal=FLAGS.causal,
      batch=FLAGS.batch, heads=FLAGS.heads, head_dim=FLAGS.head_dim,
      dtype=FLAGS.dtype, reps=FLAGS.reps, max_seconds=FLAGS.max_seconds,
      rows=FLAGS.rows, memory_limit_mb=FLAGS.memory_limit_mb,
      command='python -m experiments.bench_attention '
      + ' '.join(sys.argv[1:])))


def _define_flags() -> None:
  """The command line, defined only when this runs as a script."""
  common.define_out_flag('bench_attention')
  flags.DEFINE_list('variants', [], 'Variants to measure; xla is '
                    'jax.nn.dot_product_attention, chunked[cudnn] chunked '
                    'by that fused kernel (any of model/attention/kernels/'
                    'fused.py, for a variant taking a kernel). Empty: xla, '
                    'every registered one, and chunked by each kernel of a '
                    'GPU or TPU.')
  flags.DEFINE_list('rows', ['plain'], 'Kinds of rows to measure each on: '
                    'plain (no mask), packed (segment ids), padded (right '
                    "padding), alibi or t5 (ALiBi's or T5's position bias), "
                    'capped (logits capped at 30).')
  flags.DEFINE_list('lengths', ['1024', '2048', '4096', '8192', '16384',
                                '32768', '65536'], 'Sequence lengths.')
  flags.DEFINE_list('options', [], 'Variant options as variant.option=value '
                    'items, e.g. local.window=256.')
  flags.DEFINE_boolean('causal', True, 'Causal (decoder) attention.')
  flags.DEFINE_integer('batch', 1, 'Batch size.')
  flags.DEFINE_integer('heads', 8, 'Heads (queries, keys and values alike).')
  flags.DEFINE_integer('head_dim', 64, 'Width of each head.')
  flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16', 'float16'],
                    'Dtype of q, k and v.')
  flags.DEFINE_integer('reps', 3, 'Timed repetitions; the best is kept.')
  flags.DEFINE_float('max_seconds', 60.0, 'After a forward+backward this '
                     'slow, longer lengths of that variant are skipped.')
  flags.DEFINE_float('memory_limit_mb', 0.0, 'Skip sizes needing more; 0: '
                     'what the device holds.')


if __name__ == '__main__':
  cli.run(main, _define_flags)
