r"""Trains attention variants side by side and tabulates what each costs.

  python -m experiments.compare_attention --config=configs/listops.py \
      --variants=dense,chunked,local,linformer,performer,bigbird \
      --options=local.window=32,bigbird.block=16 --workdir=DIR \
      [--seeds=3] [--baseline=dense] [--budget=steps|flops|seconds] \
      [--sizes=64,128,256] [--lengths=512,1024,2048] [--skip_unrunnable] \
      [--config.key=value ...]

Every variant trains with the same data and model size, through
`train_and_evaluate`, once from each of --seeds seeds (config.seed + k,
k = 0 .. seeds - 1), in DIR/<variant>/seed=<k>/; a finished run (its
result.json) is not trained again. --budget says what every variant is
given the same of:
  steps    config.num_train_steps each;
  flops    the training FLOPs that --baseline spends in config.
           num_train_steps: each variant trains that many FLOPs' worth of
           steps at its own FLOPs a step (the matmuls of its compiled train
           step, train/program/flops.py's matmul_flops: a cheaper attention
           trains more steps);
  seconds  the seconds --baseline's steps take on this machine, each
           variant's step timed (the median of --timing_steps steps on a
           synthetic batch) before anything trains.
--baseline (default the first variant) is also what each variant's mean is
tested against: Welch's one-sided test that its mean is better (the
speedrun's statistics, experiments/speedrun.py), p near 0 when it is
better and near 1 when it is worse (two seeds at least).

For language models, if any variant takes key-padding masks only, every
variant reads unpacked rows, so that all see the same data. A variant that
cannot read a key/value cache trains without the decoding evaluations of
config.decode_splits and without the closing sample of a language model.
Each variant's options come from --options alone: the config's own
attention options (make train's windows by layer) are left out, as said at
start. Everything given (variant names, options, lengths, every variant's
config) is checked before anything trains: a mistake, or a variant that
cannot run the config (a causal Linformer, say), stops the comparison with
the reasons and exit status 2, nothing written. With --skip_unrunnable,
such variants are listed as skipped instead, with the reason (unless none
can run).

Writes DIR/results.md and DIR/results.csv (per variant: the task's quality
metric, its mean over the seeds, their standard deviation and p, eval loss,
the steps trained, GFLOP a step and in all, parameters, training step time
and tokens/s, and the compiled peak memory of the train step; with
--lengths, step time and memory at each length, on synthetic batches),
DIR/curves.png (training loss and the quality metric of every seed against
the budget's measure) and, with --lengths, DIR/scaling.png (step time and
memory against length, log-log, with O(n) and O(n^2) slopes for
reference). The table is printed at the end.

With --sizes (model widths), the whole comparison runs at each width
(config.model.d_model, config.model.mlp_dim scaled with it, the heads
kept) in DIR/d_model=<width>/, each with its own tables and plots, every
width's configs checked before anything trains; DIR/results.md and .csv
then hold every width's rows, and DIR/sizes.png each variant's quality
metric against its training FLOPs, a point a width: how it scales with
compute.
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

from experiments import common, speedrun
from model import attention
from train import cli
from train.base.errors import InputError
from train.config import validation as config_validation
from train.data import datasets
from train.program import flops
from train.run import workdir as workdir_lib
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


BUDGETS = ('steps', 'flops', 'seconds')


def measure(config, timing_steps: int) -> dict[str, float]:
  """Parameters, the matmul GFLOP of a train step (None where a fused
  kernel hides them), compiled memory (peak: arguments + outputs +
  temporaries; temp: the temporaries, which hold the activations) and
  (with `timing_steps`) the median step time of the train step of
  `config`, on a synthetic batch."""
  program = Program.from_config(config)
  state = program.init()
  batch = program.batch(program.task.synthetic_batch(program.config))
  rng = program.key(1)
  with program.scope():
    traced = program.train_step.trace(state, batch, rng)
    compiled = traced.lower().compile()
  memory = compiled.memory_analysis()
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  matmuls = flops.matmul_flops(traced.jaxpr.jaxpr)
  result = {'params': program.num_params,
            'gflop_per_step': None if matmuls is None else matmuls / 1e9,
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


def variant_cost(config, workdir: str, timing_steps: int) -> dict:
  """`measure(config)` of a variant, kept in workdir/cost.json for this
  config (its step timed only when `timing_steps`)."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, 'cost.json')
  described = config.to_json_best_effort(sort_keys=True)
  cost = common.load_json(path)
  if (cost is None
      or not workdir_lib.same_config(cost.pop('config'), described)
      or (timing_steps and 'step_ms' not in cost)):
    cost = measure(config, timing_steps)
    common.save_json(path, cost | {'config': described})
  return cost


def budget_steps(costs: dict[str, dict], steps: int, baseline: str,
                 budget: str, per_call: int = 1) -> dict[str, int]:
  """Each variant's training steps under `budget`: `steps` each, or as
  many as spend the FLOPs or seconds that `baseline` spends in `steps`
  (each a multiple of `per_call`, at least one call); InputError naming
  --budget where a variant's FLOPs cannot be counted."""
  if budget == 'steps':
    return {name: steps for name in costs}
  key = 'gflop_per_step' if budget == 'flops' else 'step_ms'
  uncounted = [name for name, cost in costs.items() if cost[key] is None]
  if uncounted:
    raise InputError(
        f'--budget=flops: the FLOPs of {", ".join(uncounted)} cannot be '
        'counted from the train step (a fused kernel hides its matmuls); '
        'give --config.model.kernel=xla, or --budget=steps or seconds.')
  spent = steps * costs[baseline][key]
  return {name: per_call * max(1, round(spent / cost[key] / per_call))
          for name, cost in costs.items()}


def run_seed(config, workdir: str) -> dict:
  """The figures of one trained run (trained once: kept in
  workdir/result.json for this config)."""
  os.makedirs(workdir, exist_ok=True)
  described = config.to_json_best_effort(sort_keys=True)
  row = common.load_json(os.path.join(workdir, 'result.json'))
  if row is not None and not workdir_lib.same_config(row.pop('config'),
                                                 described):
    raise InputError(f'{workdir} holds a run of another config; compare '
                     'in a new --workdir.')
  if row is None:
    summary = train_and_evaluate(config, workdir)
    logged = [line for line in common.read_metrics(workdir)
              if 'steps_per_s' in line]
    metric, _ = datasets.task_of(config.dataset).quality_metric(summary)
    row = {'metric': metric, metric: float(summary[metric]),
           'eval_loss': float(summary['eval_loss']),
           'train_step_ms': 1e3 / logged[-1]['steps_per_s'],
           'tokens_per_s': logged[-1]['tokens_per_s']}
    common.save_json(os.path.join(workdir, 'result.json'),
                     row | {'config': described})
  return row


def length_scaling(config, workdir: str, lengths: list[int],
                   timing_steps: int) -> dict:
  """Step time and compiled temporaries of `config` at each of `lengths`
  (kept in workdir/lengths.json), as the row's @length columns."""
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
  columns = {}
  for length in lengths:
    result = scaling[str(length)]
    columns[f'step_ms@{length}'] = result.get('step_ms')
    columns[f'temp_mb@{length}'] = result.get('temp_memory_mb')
  return columns


def summary_row(runs: list[dict], cost: dict, steps: int,
                against: list[float] | None, mode: str) -> dict:
  """A variant's row from its seeds' `runs`: each figure's mean, the
  quality metric's standard deviation, and p against the baseline's
  values `against` (None for the baseline itself, or a single seed)."""
  metric = runs[0]['metric']
  values = [run[metric] for run in runs]
  row = {'status': 'trained', 'metric': metric, 'values': values,
         metric: statistics.mean(values), 'steps': steps}
  if len(values) > 1:
    row[f'{metric}_sd'] = speedrun.mean_and_sd(values)[1]
    if against is not None:
      row['p'] = speedrun.p_value(values, against, mode)
  for key in ('eval_loss', 'train_step_ms', 'tokens_per_s'):
    row[key] = statistics.mean(run[key] for run in runs)
  row |= {key: cost[key] for key in ('params', 'gflop_per_step',
                                     'peak_memory_mb', 'temp_memory_mb')}
  if cost['gflop_per_step'] is not None:
    row['train_gflop'] = cost['gflop_per_step'] * steps
  return row


# The x axis of the curves under each budget: (label, a step's measure).
_CURVE_AXES = {'steps': ('step', lambda cost: 1.0),
               'flops': ('training GFLOP',
                         lambda cost: cost['gflop_per_step']),
               'seconds': ('training seconds (timed steps)',
                           lambda cost: cost['step_ms'] / 1e3)}


def plot_curves(runs: dict[str, list[str]], costs: dict[str, dict],
                metric: str, budget: str, path: str) -> None:
  """Training loss and `metric` against the budget's measure, one style
  a variant (`common.series_style`), one line a seed (`runs`: each variant's
  seed workdirs)."""
  label, per_step = _CURVE_AXES[budget]
  figure, (loss_axes, metric_axes) = plt.subplots(1, 2, figsize=(11, 4))
  for number, (name, workdirs) in enumerate(runs.items()):
    scale, style = per_step(costs[name]), common.series_style(number)
    for seed, workdir in enumerate(workdirs):
      lines = common.read_metrics(workdir)
      train = [line for line in lines if 'loss' in line]
      loss_axes.plot([l['step'] * scale for l in train],
                     [l['loss'] for l in train], **style,
                     label=None if seed else name)
      evals = [line for line in lines if metric in line]
      metric_axes.plot([l['step'] * scale for l in evals],
                       [l[metric] for l in evals], marker='o', **style,
                       label=None if seed else name)
  loss_axes.set(xlabel=label, ylabel='training loss (nats)')
  metric_axes.set(xlabel=label, ylabel=metric)
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


def _budget_words(budget: str, baseline: str, steps: int) -> str:
  return {
      'steps': f'the same steps ({steps}) for every variant',
      'flops': (f'the same training FLOPs for every variant: those of '
                f'{baseline}\'s {steps} steps (the matmuls of its compiled '
                'train step), each variant training as many steps as they '
                'buy at its own FLOPs a step'),
      'seconds': (f'the same training seconds for every variant: those of '
                  f'{baseline}\'s {steps} steps, each variant\'s step timed '
                  'on this machine before training'),
  }[budget]


def sized(base: ml_collections.ConfigDict,
          width: int) -> ml_collections.ConfigDict:
  """`base` at d_model `width`: its MLP scaled with it, its heads kept;
  InputError naming --sizes for a width the heads do not divide."""
  heads = base.model.num_heads
  if width % heads:
    raise InputError(f'--sizes: d_model {width} is not a multiple of '
                     f'config.model.num_heads={heads}.')
  config = copy.deepcopy(base)
  config.unlock()
  config.model.mlp_dim = max(1, round(base.model.mlp_dim * width
                                      / base.model.d_model))
  config.model.d_model = width
  return config


def _variant_configs(base: ml_collections.ConfigDict, variants: list[str],
                     options: dict[str, dict], *, skip_unrunnable: bool,
                     baseline: str) -> tuple[dict, dict, bool]:
  """(each variant's config, {variant: why it cannot run base}, whether
  rows are unpacked for all), every config checked; InputError for a
  variant that cannot run (unless `skip_unrunnable`), or the baseline."""
  unpacked = (datasets.task_of(base.dataset).packs and base.pack_sequences
              and any(not attention.spec(name).packs
                      for name in variants))
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
  if baseline in skipped:
    raise InputError(f'--baseline={baseline} cannot run this config '
                     f'({skipped[baseline]}).')
  return configs, skipped, unpacked


def compare(base: ml_collections.ConfigDict, variants: list[str],
            workdir: str, *, options: dict[str, dict] | None = None,
            lengths: list[int] = (), timing_steps: int = 3,
            skip_unrunnable: bool = False, seeds: int = 1,
            baseline: str | None = None, budget: str = 'steps',
            sizes: list[int] = (), command: str = '') -> list[dict]:
  """Trains and measures every variant from each seed (at each of `sizes`,
  model widths, in DIR/d_model=<width>/); writes the tables and plots.
  InputError before anything trains for a mistake in what was given, and
  (unless `skip_unrunnable`) for a variant that cannot run `base`."""
  options = options or {}
  lengths = sorted(lengths)
  for name in variants:
    common.check_variant('--variants', name)
  common.check_options(options)
  common.check_among('--options', options, variants)
  baseline = baseline or variants[0]
  common.check_among('--baseline', [baseline], variants)
  if budget not in BUDGETS:
    raise InputError(f'--budget={budget} must be one of {", ".join(BUDGETS)}.')
  if seeds < 1:
    raise InputError(f'--seeds={seeds} must be at least 1.')
  # The config's own attention's options, which each variant leaves out.
  preset = cli.drop_attention_options(copy.deepcopy(base),
                                      keep=lambda key, value: False)
  # Every variant's config (at every size) is checked before any trains.
  settings = dict(lengths=lengths, timing_steps=timing_steps, seeds=seeds,
                  baseline=baseline, budget=budget, options=options,
                  command=command)
  places = ([(sized(base, width), os.path.join(workdir, f'd_model={width}'))
             for width in sorted(sizes)] if sizes else [(base, workdir)])
  plans = [(config, directory,
            _variant_configs(config, variants, options,
                             skip_unrunnable=skip_unrunnable,
                             baseline=baseline))
           for config, directory in places]
  if preset:
    print(f'config.model.attention_options ({preset}) belong to '
          f'config.model.attention={base.model.attention!r}, which each '
          'variant replaces: left out; a variant takes its options from '
          '--options, e.g. --options=local.window=32.', flush=True)
  rows = []
  for config, directory, (configs, skipped, unpacked) in plans:
    if sizes:
      print(f'd_model {config.model.d_model}', flush=True)
    compared = _compare(config, variants, directory, configs, skipped,
                        unpacked, **settings)
    rows += [row | {'d_model': config.model.d_model} for row in compared
             ] if sizes else compared
  if sizes:
    _write_sizes(rows, workdir, base, sorted(sizes), seeds=seeds,
                 baseline=baseline, budget=budget, command=command)
  return rows


def _compare(base: ml_collections.ConfigDict, variants: list[str],
             workdir: str, configs: dict, skipped: dict, unpacked: bool, *,
             lengths: list[int], timing_steps: int, seeds: int,
             baseline: str, budget: str, options: dict[str, dict],
             command: str) -> list[dict]:
  """`compare` at one size: each runnable variant of `configs` trained
  from each seed, its row measured; the tables and plots written in
  `workdir`."""
  os.makedirs(workdir, exist_ok=True)
  runnable = [name for name in variants if name not in skipped]
  costs = {name: variant_cost(configs[name], os.path.join(workdir, name),
                              timing_steps if budget == 'seconds' else 0)
           for name in runnable}
  steps = budget_steps(costs, base.num_train_steps, baseline, budget,
                       base.steps_per_call)
  for name, why in skipped.items():
    print(f'variant {name}: skipped: {why}', flush=True)
  results, seed_dirs = {}, {}
  for number, name in enumerate(runnable, 1):
    print(f'variant {number}/{len(runnable)} {name}: {steps[name]} steps',
          flush=True)
    seed_dirs[name] = [os.path.join(workdir, name, f'seed={seed}')
                       for seed in range(seeds)]
    results[name] = []
    for seed, seed_dir in enumerate(seed_dirs[name]):
      config = copy.deepcopy(configs[name])
      config.seed = base.seed + seed
      config.num_train_steps = steps[name]
      results[name].append(run_seed(config, seed_dir))
  metric = results[baseline][0]['metric']
  _, mode = datasets.task_of(base.dataset).quality_metric({metric: 0.0})
  rows = []
  for name in variants:
    if name in skipped:
      rows.append({'variant': name, 'status': f'skipped: {skipped[name]}'})
      continue
    against = (None if name == baseline else
               [run[metric] for run in results[baseline]])
    row = {'variant': name} | summary_row(results[name], costs[name],
                                          steps[name], against, mode)
    rows.append(row | length_scaling(configs[name],
                                     os.path.join(workdir, name),
                                     list(lengths), timing_steps))
  columns = ['variant', 'status', metric]
  if seeds > 1:
    columns += [f'{metric}_sd', 'p']
  columns += ['eval_loss', 'steps', 'gflop_per_step', 'train_gflop',
              'params', 'train_step_ms', 'tokens_per_s', 'peak_memory_mb',
              'temp_memory_mb']
  columns += [f'{key}@{n}' for n in lengths for key in ('step_ms', 'temp_mb')]
  preamble = f'# Attention variants: {base.dataset}\n\n'
  if command:
    preamble += f'Command: `{command}`\n\n'
  seeded = (f'{seeds} seeds ({base.seed} to {base.seed + seeds - 1}): '
            f'{metric} is their mean, {metric}_sd their standard deviation, '
            f'p Welch\'s one-sided test that the variant\'s mean is better '
            f'than {baseline}\'s (near 0: better, near 1: worse)'
            if seeds > 1 else f'seed {base.seed}')
  preamble += (
      f'Machine: {common.machine_description()}.\n\n'
      f'Same data and model size for every variant, '
      f'{_budget_words(budget, baseline, base.num_train_steps)}; {seeded}; '
      'options: '
      f'{json.dumps(options) if options else "defaults"}'
      f'{"; rows unpacked for every variant" if unpacked else ""}. '
      'gflop_per_step counts the matmuls of the compiled train step (empty '
      'where a fused kernel hides them), train_gflop those of all its '
      'steps; train_step_ms and tokens_per_s are those of the last logged '
      'interval of training (the mean over the seeds); peak_memory_mb is '
      'the compiled train step\'s (arguments + outputs + temporaries), '
      'temp_memory_mb its temporaries (the activations); the @length '
      'columns time a train step and compile its temporaries on synthetic '
      'batches of that length (empty: it failed, see '
      'DIR/<variant>/lengths.json).\n\n')
  table = common.write_table(rows, columns, os.path.join(workdir, 'results'),
                             preamble)
  plot_curves(seed_dirs, costs, metric, budget,
              os.path.join(workdir, 'curves.png'))
  if lengths:
    plot_scaling([row for row in rows if row['status'] == 'trained'],
                 list(lengths), os.path.join(workdir, 'scaling.png'))
  print(table)
  return rows


def _write_sizes(rows: list[dict], workdir: str,
                 base: ml_collections.ConfigDict, sizes: list[int], *,
                 seeds: int, baseline: str, budget: str,
                 command: str) -> None:
  """DIR/results.md and .csv of every size's rows, and DIR/sizes.png: each
  variant's quality metric against its training FLOPs, one point a size."""
  trained = [row for row in rows if row['status'] == 'trained']
  metric = trained[0]['metric']
  columns = ['d_model', 'variant', 'status', metric]
  if seeds > 1:
    columns += [f'{metric}_sd', 'p']
  columns += ['eval_loss', 'steps', 'train_gflop', 'params']
  preamble = (f'# Attention variants against compute: {base.dataset}\n\n'
              + (f'Command: `{command}`\n\n' if command else '')
              + f'Machine: {common.machine_description()}.\n\n'
              f'At each d_model ({", ".join(map(str, sizes))}; MLPs scaled '
              f'with it, {base.model.num_heads} heads), '
              f'{_budget_words(budget, baseline, base.num_train_steps)}; '
              f'{seeds} seed(s). Each size\'s own table: '
              'DIR/d_model=<width>/results.md.\n\n')
  table = common.write_table(rows, columns, os.path.join(workdir, 'results'),
                             preamble)
  figure, axes = plt.subplots(figsize=(6, 4))
  for number, name in enumerate(
      dict.fromkeys(row['variant'] for row in trained)):
    points = sorted((row['train_gflop'], row[metric]) for row in trained
                    if row['variant'] == name and row.get('train_gflop'))
    if points:
      axes.plot(*zip(*points), marker='o', label=name,
                **common.series_style(number))
  axes.set(xscale='log', xlabel='training GFLOP (matmuls)', ylabel=metric)
  axes.legend()
  figure.tight_layout()
  figure.savefig(os.path.join(workdir, 'sizes.png'), dpi=120)
  plt.close(figure)
  print(table)


def main(argv: list[str]) -> None:
  cli.run_main(argv, lambda: compare(
      FLAGS.config, FLAGS.variants, common.local_workdir(FLAGS.workdir),
      options=common.parse_options(FLAGS.options),
      lengths=common.parse_integers('--lengths', FLAGS.lengths),
      timing_steps=FLAGS.timing_steps, skip_unrunnable=FLAGS.skip_unrunnable,
      seeds=FLAGS.seeds, baseline=FLAGS.baseline, budget=FLAGS.budget,
      sizes=common.parse_integers('--sizes', FLAGS.sizes),
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
  flags.DEFINE_integer(
      'seeds', 1, 'Runs of each variant, from config.seed, config.seed + 1, '
      '...: the table gives their mean, standard deviation and p.')
  flags.DEFINE_string(
      'baseline', None, 'The variant the others are tested against, and '
      'whose training FLOPs or seconds the budget gives each (default: the '
      'first of --variants).')
  flags.DEFINE_enum(
      'budget', 'steps', list(BUDGETS), 'What every variant gets the same '
      'of: training steps, training FLOPs (a cheaper variant trains more '
      'steps), or training seconds on this machine.')
  flags.DEFINE_list(
      'sizes', [], 'Model widths (config.model.d_model, the MLP scaled with '
      'it): the comparison at each, in DIR/d_model=<width>/, and each '
      "variant's quality against its training FLOPs (DIR/sizes.png).")
  flags.DEFINE_boolean(
      'skip_unrunnable', False, 'List the variants that cannot run the '
      'config as skipped, with the reason, and compare the others; without '
      'it, such a variant stops the comparison before anything trains.')
  flags.mark_flags_as_required(['config', 'variants', 'workdir'])


if __name__ == '__main__':
  cli.run(main, _define_flags)
