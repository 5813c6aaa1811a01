r"""Trains attention variants side by side and tabulates what each costs.

  python -m experiments.compare_attention --config=configs/listops.py \
      --variants=dense,chunked,local,linformer,performer,bigbird \
      --options=local.window=32,bigbird.block=16 --workdir=DIR \
      [--lengths=512,1024,2048] [--skip_unrunnable] [--config.key=value ...]

Every variant trains with the same seed, data, steps and model size, through
`train_and_evaluate`, in DIR/<variant>/; a finished variant (its
result.json) is not trained again. For language models, if any variant
takes key-padding masks only, every variant reads unpacked rows, so that all
see the same data. A variant that cannot read a key/value cache trains
without the decoding evaluations of config.decode_splits and without the
closing sample of a language model. Each variant's options come from
--options alone: the config's own attention options (make train's windows
by layer) are left out, as said at start. Everything given (variant
names, options, lengths, every variant's config) is checked before
anything trains: a mistake, or a variant that cannot run the config (a
causal Linformer, say), stops the comparison with the reasons and exit
status 2, nothing written. With --skip_unrunnable, such variants are
listed as skipped instead, with the reason (unless none can run).

Writes DIR/results.md and DIR/results.csv (per variant: the task's quality
metric, eval loss, parameters, training step time and tokens/s, and the
compiled peak memory of the train step; with --lengths, step time and
memory at each length, on synthetic batches), DIR/curves.png (training loss
and the quality metric against steps) and, with --lengths,
DIR/scaling.png (step time and memory against length, log-log, with O(n)
and O(n^2) slopes for reference). The table is printed at the end.
"""

import copy
import json
import os
import statistics
import sys
import time

from absl import flags
import jax
import matplotlib
import ml_collections
from ml_collections import config_flags

from experiments import common
from model import attention
from train import cli
from train.base.errors import InputError
from train.config import validation as config_validation
from train.data import datasets
from train.run.program import Program
from train.run.trainer import train_and_evaluate

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)

FLAGS = flags.FLAGS


def variant_config(base: ml_collections.ConfigDict, name: str,
                   options: dict[str, dict], unpacked: bool):
  """`base` with attention `name` and its `options` alone: the options
  `base` set for its own attention go with it."""
  config = copy.deepcopy(base)
  config.unlock()
  config.model.attention = name
  cli.drop_attention_options(config, keep=lambda key, value: False)
  for option, value in options.get(name, {}).items():
    try:
      config.model.attention_options[option] = value
    except TypeError as error:  # ml_collections' check of the type.
      raise InputError(f'--options: {name}.{option}={value!r}: {error}'
                       ) from None
  if unpacked:
    config.pack_sequences = False
  if not attention.spec(name).reads_cache:
    config.decode_splits = ()
    config.sample_length = 0
  return config


def measure(config, timing_steps: int) -> dict[str, float]:
  """Parameters, compiled memory (peak: arguments + outputs + temporaries;
  temp: the temporaries, which hold the activations) and (with
  `timing_steps`) the median step time of the train step of `config`, on a
  synthetic batch."""
  program = Program.from_config(config)
  state = program.init()
  batch = program.batch(program.task.synthetic_batch(program.config))
  rng = program.key(1)
  with program.scope():
    compiled = program.train_step.lower(state, batch, rng).compile()
  memory = compiled.memory_analysis()
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  result = {'params': program.num_params,
            'peak_memory_mb': peak / 2**20,
            'temp_memory_mb': memory.temp_size_in_bytes / 2**20}
  if timing_steps:
    times = []
    for _ in range(timing_steps + 1):  # The first warms up.
      start = time.perf_counter()
      state, sums = compiled(state, batch, rng)
      jax.block_until_ready(sums)
      times.append(time.perf_counter() - start)
    result['step_ms'] = 1e3 * statistics.median(times[1:])
  return result


def run_variant(config, workdir: str, lengths: list[int],
                timing_steps: int) -> dict:
  """The row of one variant: trained (once) and measured."""
  os.makedirs(workdir, exist_ok=True)
  described = config.to_json_best_effort(sort_keys=True)
  row = common.load_json(os.path.join(workdir, 'result.json'))
  if row is not None and row.pop('config') != described:
    raise InputError(f'{workdir} holds a run of another config; compare '
                     'in a new --workdir.')
  if row is None:
    summary = train_and_evaluate(config, workdir)
    logged = [line for line in common.read_metrics(workdir)
              if 'steps_per_s' in line]
    metric, _ = datasets.task_of(config.dataset).quality_metric(summary)
    row = {'status': 'trained', 'metric': metric,
           metric: float(summary[metric]),
           'eval_loss': float(summary['eval_loss']),
           'train_step_ms': 1e3 / logged[-1]['steps_per_s'],
           'tokens_per_s': logged[-1]['tokens_per_s']}
    row |= measure(config, timing_steps=0)
    common.save_json(os.path.join(workdir, 'result.json'),
                     row | {'config': described})
  scaling_path = os.path.join(workdir, 'lengths.json')
  scaling = common.load_json(scaling_path) or {}
  for length in lengths:
    if str(length) in scaling:
      continue
    print(f'  timing a train step at length {length}', flush=True)
    long = copy.deepcopy(config)
    long.seq_len = length
    long.model.max_len = max(long.model.max_len, length + 1)
    try:
      scaling[str(length)] = measure(long, timing_steps)
    except Exception as error:  # pylint: disable=broad-except
      # Out of memory, or a length the variant cannot take: recorded, so
      # that a re-run does not try it again.
      scaling[str(length)] = {'error': str(error).splitlines()[0]}
    common.save_json(scaling_path, scaling)
  for length in lengths:
    result = scaling[str(length)]
    row[f'step_ms@{length}'] = result.get('step_ms')
    row[f'temp_mb@{length}'] = result.get('temp_memory_mb')
  return row


def plot_curves(names: list[str], workdir: str, metric: str,
                path: str) -> None:
  figure, (loss_axes, metric_axes) = plt.subplots(1, 2, figsize=(11, 4))
  for name in names:
    lines = common.read_metrics(os.path.join(workdir, name))
    train = [line for line in lines if 'loss' in line]
    loss_axes.plot([l['step'] for l in train], [l['loss'] for l in train],
                   label=name)
    evals = [line for line in lines if metric in line]
    metric_axes.plot([l['step'] for l in evals], [l[metric] for l in evals],
                     marker='o', label=name)
  loss_axes.set(xlabel='step', ylabel='training loss (nats)')
  metric_axes.set(xlabel='step', ylabel=metric)
  loss_axes.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def plot_scaling(rows: list[dict], lengths: list[int], path: str) -> None:
  common.plot_against_length(
      [(label, {row['variant']: [(n, row.get(f'{key}@{n}')) for n in lengths]
                for row in rows})
       for key, label in (('step_ms', 'train step (ms)'),
                          ('temp_mb', 'compiled temporary memory (MiB)'))],
      path)


def compare(base: ml_collections.ConfigDict, variants: list[str],
            workdir: str, *, options: dict[str, dict] | None = None,
            lengths: list[int] = (), timing_steps: int = 3,
            skip_unrunnable: bool = False, command: str = '') -> list[dict]:
  """Trains and measures every variant; writes the tables and plots.
  InputError before anything trains for a mistake in what was given, and
  (unless `skip_unrunnable`) for a variant that cannot run `base`."""
  options = options or {}
  lengths = sorted(lengths)
  for name in variants:
    common.check_variant('--variants', name)
  common.check_options(options)
  common.check_among('--options', options, variants)
  # The config's own attention's options, which each variant leaves out.
  preset = cli.drop_attention_options(copy.deepcopy(base),
                                      keep=lambda key, value: False)
  unpacked = (datasets.task_of(base.dataset).packs and base.pack_sequences
              and any(not attention.spec(name).packs
                      for name in variants))
  # Every variant's config is checked before any trains.
  configs, skipped = {}, {}
  for name in variants:
    configs[name] = variant_config(base, name, options, unpacked)
    try:
      config_validation.validate(configs[name])
    except InputError as error:
      skipped[name] = ' '.join(str(error).splitlines())
  reasons = '; '.join(f'{name}: {why}' for name, why in skipped.items())
  if len(skipped) == len(variants):
    raise InputError(f'no variant can run this config: {reasons}')
  if skipped and not skip_unrunnable:
    raise InputError(
        f'--variants: {", ".join(skipped)} cannot run this config '
        f'({reasons}); leave {"it" if len(skipped) == 1 else "them"} out, '
        'or give --skip_unrunnable to compare the others.')
  if preset:
    print(f'config.model.attention_options ({preset}) belong to '
          f'config.model.attention={base.model.attention!r}, which each '
          'variant replaces: left out; a variant takes its options from '
          '--options, e.g. --options=local.window=32.', flush=True)
  os.makedirs(workdir, exist_ok=True)
  rows, metric = [], None
  for number, name in enumerate(variants, 1):
    if name in skipped:
      print(f'variant {number}/{len(variants)} {name}: skipped: '
            f'{skipped[name]}', flush=True)
      rows.append({'variant': name, 'status': f'skipped: {skipped[name]}'})
      continue
    print(f'variant {number}/{len(variants)} {name}', flush=True)
    row = {'variant': name} | run_variant(
        configs[name], os.path.join(workdir, name), list(lengths),
        timing_steps)
    metric = row['metric']
    rows.append(row)
  columns = ['variant', 'status', metric or 'metric', 'eval_loss', 'params',
             'train_step_ms', 'tokens_per_s', 'peak_memory_mb',
             'temp_memory_mb']
  columns += [f'{key}@{n}' for n in lengths for key in ('step_ms', 'temp_mb')]
  trained = [row['variant'] for row in rows if row['status'] == 'trained']
  preamble = f'# Attention variants: {base.dataset}\n\n'
  if command:
    preamble += f'Command: `{command}`\n\n'
  preamble += (
      f'Machine: {common.machine_description()}.\n\n'
      f'Same seed, data, steps ({base.num_train_steps}) and model size for '
      'every variant; options: '
      f'{json.dumps(options) if options else "defaults"}'
      f'{"; rows unpacked for every variant" if unpacked else ""}. '
      'train_step_ms and tokens_per_s are those of the last logged interval '
      'of training; peak_memory_mb is the compiled train step\'s (arguments '
      '+ outputs + temporaries), temp_memory_mb its temporaries (the '
      'activations); the @length columns time a train step and compile its '
      'temporaries on synthetic batches of that length (empty: it failed, '
      'see DIR/<variant>/lengths.json).\n\n')
  table = common.write_table(rows, columns, os.path.join(workdir, 'results'),
                             preamble)
  if trained:
    plot_curves(trained, workdir, metric, os.path.join(workdir, 'curves.png'))
  if lengths and trained:
    plot_scaling([row for row in rows if row['status'] == 'trained'],
                 list(lengths), os.path.join(workdir, 'scaling.png'))
  print(table)
  return rows


def main(argv: list[str]) -> None:
  cli.run_main(argv, lambda: compare(
      FLAGS.config, FLAGS.variants, common.local_workdir(FLAGS.workdir),
      options=common.parse_options(FLAGS.options),
      lengths=common.parse_integers('--lengths', FLAGS.lengths),
      timing_steps=FLAGS.timing_steps, skip_unrunnable=FLAGS.skip_unrunnable,
      command='python -m experiments.compare_attention '
      + ' '.join(sys.argv[1:])))


def _define_flags() -> None:
  """The command line, defined only when this runs as a script (so that
  the experiment modules can be imported together)."""
  config_flags.DEFINE_config_file(
      'config', None, 'Experiment config file, optionally with :argument.',
      lock_config=True)
  flags.DEFINE_list(
      'variants', None, 'Attention variants to compare, e.g. dense,chunked.')
  flags.DEFINE_list(
      'options', [], 'Variant options as variant.option=value items, e.g. '
      'local.window=32,bigbird.block=16.')
  flags.DEFINE_string(
      'workdir', None, 'Directory of the comparison; each variant trains in a '
      'sub-directory.')
  flags.DEFINE_list(
      'lengths', [], 'Sequence lengths at which to time a train step and '
      'compile its memory, on synthetic batches.')
  flags.DEFINE_integer(
      'timing_steps', 3, 'Steps timed (after one warm-up) at each length.')
  flags.DEFINE_boolean(
      'skip_unrunnable', False, 'List the variants that cannot run the '
      'config as skipped, with the reason, and compare the others; without '
      'it, such a variant stops the comparison before anything trains.')
  flags.mark_flags_as_required(['config', 'variants', 'workdir'])


if __name__ == '__main__':
  cli.run(main, _define_flags)
