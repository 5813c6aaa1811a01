r"""Transplants attention variants into a trained language model and
measures how much of its quality each recovers, after how many steps.

  python -m experiments.transplant --from=W --workdir=DIR \
      --variants=linear,hedgehog,performer,local --steps=N \
      [--distill_steps=M --distill=new|qk --distill_learning_rate=0.01] \
      [--learning_rate_scale=0.1] [--train=all|attention] \
      [--options=local.window=64] \
      [--model=linear.position=none] [--eval_every=K]

Each variant starts from W's parameters (config.init_from: the run's config
with config.model.attention set to the variant, its own new parameters
fresh), then:
  stage 1 (with --distill_steps): attention transfer
    (train/run/attention_transfer.py): the variant's new parameters (with
    --distill=qk the query and key projections too) learn for M steps to
    give W's attention outputs, layer by layer, on the same inputs; a
    variant with nothing to learn skips it;
  stage 2: N steps of fine-tuning (train_and_evaluate) of the whole model,
    or with --train=attention of the self-attention layers alone
    (config.trained_params), on W's config: its data, optimizer and
    schedule over N steps, its peak learning rates times
    --learning_rate_scale (0.1 by default: at W's own they would undo some
    of W's training).
Beside them, the source is evaluated, and each variant is trained from
scratch for the same N steps at W's rates. --model sets a variant's
config.model keys (a kernelised attention takes no ALiBi bias: with
linear.position=none it runs without). Every config is checked (and
init_from's fit of W's parameters) before anything trains: a variant that
cannot take the source stops the command naming it, exit status 2,
nothing written. The layers are not scanned (the transfer reads each
layer's calls).

Writes DIR/results.md and .csv (per variant: the quality metric of W's
task, bits per byte for a byte-level corpus, before any step, after stage
1, after stage 2 and from scratch, against the source's; stage 1's
attention-output error before and after it; the compiled step's peak
memory and its time at W's length), DIR/curves.png and, per variant,
DIR/<variant>/ (transferred/: the model after stage 1, a run init_from
reads; tuned/ and scratch/: the stage-2 and scratch runs). A finished
variant (its result.json) is not run again.
"""

import copy
import json
import os
import sys

from absl import flags
from flax import traverse_util
import jax
import matplotlib

from configs import published
from experiments import common, compare_attention
from experiments.import_checkpoint import write_start
from train import cli
from model import attention
from train.base import storage
from train.base.errors import InputError, did_you_mean
from train.data import datasets
from train.run import attention_transfer, init_from, trainer, trained_run
from train.run.program import Program
from train.run.trainer import train_and_evaluate

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)

FLAGS = flags.FLAGS
# What stage 1 teaches: the variant's new parameters, or with them the
# query and key projections.
DISTILL = ('new', 'qk')
# What stage 2 trains (config.trained_params).
TRAINED = ('all', 'attention')
TRAINED_SAID = {'all': 'the whole model',
                'attention': 'the attention layers alone'}


def stage_config(source: str, name: str, options: dict[str, dict],
                 model: dict[str, dict], *, steps: int, eval_every: int,
                 unpacked: bool):
  """The config of a variant's stage 2: W's run (published.py:from=W) with
  attention `name` and its `options`, its `model` keys set, over `steps`
  steps, its layers unscanned, its rows `unpacked` or as W's."""
  base = published.get_config(f'from={source}')
  base.model.scan_layers = False
  config = compare_attention.variant_config(base, name, options, unpacked)
  for key, value in model.get(name, {}).items():
    if key not in config.model:
      raise InputError(f'--model: {name}.{key}: config.model has no key '
                       f'{key!r}{did_you_mean(key, list(config.model))}')
    config.model[key] = value
  config.update(num_train_steps=steps, eval_every=eval_every,
                checkpoint_every=steps, keep_checkpoints=1,
                warmup_steps=min(config.warmup_steps, steps // 10),
                log_every=max(1, min(config.log_every, eval_every)))
  return config


def _checked(configs: dict, workdir: str) -> dict[str, Program]:
  """The programs of every variant's config; InputError naming the
  variants whose config, or fit of the source's parameters, is refused."""
  programs, refused = {}, []
  for name, config in configs.items():
    try:
      programs[name] = Program.from_config(config)
      init_from.check_fits(programs[name], os.path.join(workdir, name))
    except InputError as error:
      refused.append(f'{name}: {" ".join(str(error).splitlines())}')
  if refused:
    raise InputError(f'--variants: {"; ".join(refused)}')
  return programs


def _evaluate(program: Program, dataset: datasets.Dataset, params,
              workdir: str) -> dict[str, float]:
  return trainer.evaluation(program.config, dataset, program, workdir,
                            trainer.row_layout(program.config))(params)


def _stage_one(teacher: Program, teacher_params, config, student: Program,
               dataset: datasets.Dataset,
               transferred: init_from.Transferred, workdir: str, *,
               steps: int, distill: str, learning_rate: float,
               metric: str) -> dict:
  """Stage 1 of one variant (`config`, its program `student`): its row's
  figures (`metric` after it), kept in workdir/stage_1.json, and its run in
  workdir/transferred, which stage 2 starts from (neither where it has
  nothing to learn)."""
  trainable = list(transferred.fresh)
  if distill == 'qk':
    trainable += [path for path in transferred.taken + transferred.pooled
                  if path.split('/')[-2] in ('query', 'key')]
  if not trainable:
    return {'stage_1': 'nothing to learn'}
  figures_path = os.path.join(workdir, 'stage_1.json')
  run = os.path.join(workdir, 'transferred')
  figures = common.load_json(figures_path)
  if figures is not None:  # Done before stage 2 stopped.
    return figures
  if storage.path(run).exists():  # Stopped before its figures were kept.
    storage.path(run).rmtree()
  batches = trainer.training_batches(student, dataset)
  error = jax.jit(lambda teacher_params, params, batch: (
      attention_transfer.layer_errors(teacher, student, teacher_params,
                                      params, batch).mean()))
  try:
    held_out = student.batch(next(batches))
    with student.scope():
      before = float(error(teacher_params, transferred.params, held_out))
    params = attention_transfer.transfer(
        teacher, student, teacher_params, transferred.params, trainable,
        batches, steps=steps, learning_rate=learning_rate)
    with student.scope():
      after = float(error(teacher_params, params, held_out))
  finally:
    batches.close()
  print(f'  stage 1: attention-output error {before:.4g} -> {after:.4g} '
        f'({steps} steps, {len(trainable)} arrays trained)', flush=True)
  start = copy.deepcopy(config)
  start.init_from = None
  write_start(start, student, dataset, params, run)
  figures = {'stage_1': f'{len(trainable)} arrays trained',
             'error_before': before, 'error_after': after,
             'after_stage_1': float(_evaluate(student, dataset, params,
                                              workdir)[metric])}
  common.save_json(figures_path, figures)
  return figures


def _variant(source: str, config, program: Program, teacher: Program,
             teacher_params, dataset: datasets.Dataset, workdir: str, *, distill_steps: int,
             distill: str, learning_rate: float, learning_rate_scale: float,
             train: str, metric: str) -> dict:
  """One variant's row: its stages, its scratch run and its cost (kept in
  workdir/result.json, with what made it)."""
  described = json.dumps([
      json.loads(config.to_json_best_effort(sort_keys=True)),
      dict(distill_steps=distill_steps, distill=distill,
           learning_rate=learning_rate,
           learning_rate_scale=learning_rate_scale, train=train)])
  path = os.path.join(workdir, 'result.json')
  row = common.load_json(path)
  if row is not None:
    if row.pop('config') != described:
      raise InputError(f'{workdir} holds a transplant of another config '
                       'or other stages; give a new --workdir.')
    return row
  transferred, said = init_from.load(source, program)
  print(f'  starting from {said}', flush=True)
  flat = traverse_util.flatten_dict(transferred.params, sep='/')
  row = {'new_params': sum(flat[path].size for path in transferred.fresh),
         'before': float(_evaluate(program, dataset, transferred.params,
                                   workdir)[metric])}
  # Fine-tuning a trained model: its peak learning rates scaled down.
  tuned = copy.deepcopy(config)
  tuned.learning_rate *= learning_rate_scale
  tuned.muon_learning_rate *= learning_rate_scale
  tuned.trained_params = train
  if distill_steps:
    stage = _stage_one(teacher, teacher_params, config, program, dataset,
                       transferred, workdir, steps=distill_steps,
                       distill=distill, learning_rate=learning_rate,
                       metric=metric)
    if 'after_stage_1' in stage:
      tuned.init_from = os.path.join(workdir, 'transferred')
    row |= stage
  row['after_stage_2'] = float(train_and_evaluate(
      tuned, os.path.join(workdir, 'tuned'))[metric])
  scratch = copy.deepcopy(config)
  scratch.init_from = None
  row['scratch'] = float(train_and_evaluate(
      scratch, os.path.join(workdir, 'scratch'))[metric])
  row |= compare_attention.measure(config, timing_steps=3)
  common.save_json(path, row | {'config': described})
  return row


def _curves(names: list[str], workdir: str, metric: str, source: float,
            path: str) -> None:
  """The metric along stage 2 (solid) and from scratch (dashed) per
  variant, its value before any step and after stage 1 at step 0, and the
  source's."""
  figure, axes = plt.subplots(figsize=(7, 4.5))
  for name, color in zip(names, plt.rcParams['axes.prop_cycle'].by_key()[
      'color'] * 3):
    row = common.load_json(os.path.join(workdir, name, 'result.json'))
    for run, style in (('tuned', '-'), ('scratch', '--')):
      evals = [line for line in common.read_metrics(
          os.path.join(workdir, name, run)) if metric in line]
      start = [(0, row.get('after_stage_1', row['before']))] if (
          run == 'tuned') else []
      steps, values = zip(*(start + [(line['step'], line[metric])
                                     for line in evals]))
      kind = 'transplanted' if run == 'tuned' else 'scratch'
      axes.plot(steps, values, style, color=color, marker='.',
                label=f'{name} ({kind})')
    axes.plot([0], [row['before']], 'x', color=color)
  axes.axhline(source, color='black', linewidth=1, label='source')
  axes.set(xlabel='fine-tuning step', ylabel=metric,
           title='x: before any step; first dot: after stage 1')
  axes.legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def transplant(source: str, variants: list[str], workdir: str, *,
               steps: int, distill_steps: int = 0, distill: str = 'new',
               learning_rate: float = 1e-2, learning_rate_scale: float = 0.1,
               train: str = 'all',
               options: dict[str, dict] | None = None,
               model: dict[str, dict] | None = None,
               eval_every: int | None = None, command: str = ''
               ) -> list[dict]:
  """Runs every variant (see the module docstring); writes the table and
  the curves; returns the rows. InputError before anything trains for a
  mistake in what was given or a variant that cannot take the source."""
  options, model = options or {}, model or {}
  for name, value, ok, must in (
      ('steps', steps, steps >= 1, 'at least 1'),
      ('distill_steps', distill_steps, distill_steps >= 0, '>= 0'),
      ('distill', distill, distill in DISTILL, f'one of {list(DISTILL)}'),
      ('distill_learning_rate', learning_rate, learning_rate > 0, '> 0'),
      ('learning_rate_scale', learning_rate_scale, learning_rate_scale > 0,
       '> 0'),
      ('train', train, train in TRAINED, f'one of {list(TRAINED)}')):
    if not ok:
      raise InputError(f'--{name}={value!r} must be {must}.')
  problem = init_from.source_problem(source, f'--from={source}')
  if problem:
    raise InputError(problem)
  for name in variants:
    common.check_variant('--variants', name)
  common.check_options(options)
  common.check_among('--options', options, variants)
  common.check_among('--model', model, variants)
  eval_every = eval_every or max(1, steps // 4)
  # Rows unpacked for every variant (and the source's evaluation) where
  # one reads key-padding masks only: all see the same data.
  unpacked = any(not attention.spec(name).packs for name in variants)
  configs = {name: stage_config(source, name, options, model, steps=steps,
                                eval_every=eval_every, unpacked=unpacked)
             for name in variants}
  programs = _checked(configs, workdir)
  run, step = init_from.run_source(source)
  teacher_config = copy.deepcopy(next(iter(configs.values())))
  teacher_config.model = trained_run.load_config(run).model
  teacher_config.model.scan_layers = False
  teacher_config.init_from = None
  teacher = Program.from_config(teacher_config)
  _, teacher_params = trained_run.restore_params(
      run, teacher.abstract_state.params, step)
  os.makedirs(workdir, exist_ok=True)
  # The variants read the source's dataset (their configs differ in the
  # model and the rows' layout only): loaded once.
  dataset = datasets.load(teacher.config, workdir)
  source_summary = _evaluate(teacher, dataset, teacher_params, workdir)
  metric, _ = datasets.task_of(teacher_config.dataset).quality_metric(
      source_summary)
  rows = []
  for number, name in enumerate(variants, 1):
    print(f'variant {number}/{len(variants)} {name}', flush=True)
    rows.append({'variant': name, 'source': float(source_summary[metric])} | (
        _variant(source, configs[name], programs[name], teacher,
                 teacher_params, dataset, os.path.join(workdir, name),
                 distill_steps=distill_steps, distill=distill,
                 learning_rate=learning_rate,
                 learning_rate_scale=learning_rate_scale, train=train,
                 metric=metric)))
  columns = ['variant', 'new_params', 'source', 'before', 'stage_1',
             'error_before', 'error_after', 'after_stage_1', 'after_stage_2',
             'scratch', 'step_ms', 'peak_memory_mb']
  preamble = (
      f'# Attention transplanted into {source}\n\n'
      + (f'Command: `{command}`\n\n' if command else '')
      + f'Machine: {common.machine_description()}.\n\n'
      f'{metric} of the validation split ({teacher_config.eval_split}, '
      + ('whole' if teacher_config.num_eval_steps == -1
         else f'{teacher_config.num_eval_steps} batches')
      + '): `source`, the model the '
      'variants start from; `before`, a variant with its parameters and no '
      f'step; `after_stage_1`, after {distill_steps} steps of attention '
      f'transfer (`error_*`: the attention-output error, mean over layers, '
      f'on a held-out batch; --distill={distill}); `after_stage_2`, after '
      f'{steps} steps of fine-tuning ({TRAINED_SAID[train]}) at '
      f'{learning_rate_scale} times the source config\'s peak learning '
      'rates (its schedule over those steps); `scratch`, the variant '
      f'trained from scratch for the same {steps} steps at the source '
      'config\'s rates. `step_ms` and `peak_memory_mb`: '
      'the compiled train step at the run\'s length (median of 3 steps; '
      'arguments, outputs and temporaries).\n\n')
  table = common.write_table(rows, columns, os.path.join(workdir, 'results'),
                             preamble)
  _curves(variants, workdir, metric, source_summary[metric],
          os.path.join(workdir, 'curves.png'))
  print(table)
  return rows


def main(argv: list[str]) -> None:
  cli.run_main(argv, lambda: transplant(
      FLAGS['from'].value, FLAGS.variants,
      common.local_workdir(FLAGS.workdir), steps=FLAGS.steps,
      distill_steps=FLAGS.distill_steps, distill=FLAGS.distill,
      learning_rate=FLAGS.distill_learning_rate,
      learning_rate_scale=FLAGS.learning_rate_scale, train=FLAGS.train,
      options=common.parse_options(FLAGS.options),
      model=common.parse_options(FLAGS.model, '--model'),
      eval_every=FLAGS.eval_every,
      command='python -m experiments.transplant ' + ' '.join(sys.argv[1:])))


def _define_flags() -> None:
  flags.DEFINE_string('from', None, 'The trained model: a training run\'s '
                      'workdir (an import, or any language model run), or '
                      'one of its checkpoints (WORKDIR/checkpoints/STEP).')
  flags.DEFINE_list('variants', None, 'Attention variants to transplant, '
                    'e.g. linear,hedgehog,local.')
  flags.DEFINE_string('workdir', None, 'Directory of the experiment; each '
                      'variant runs in a sub-directory.')
  flags.DEFINE_integer('steps', None, 'Fine-tuning steps (stage 2), and '
                       'the scratch runs\' steps.')
  flags.DEFINE_integer('distill_steps', 0, 'Attention-transfer steps '
                       '(stage 1); 0 skips it.')
  flags.DEFINE_enum('distill', 'new', DISTILL, 'What stage 1 trains: the '
                    'variant\'s new parameters, or with them the query and '
                    'key projections.')
  flags.DEFINE_float('distill_learning_rate', 1e-2, 'Adam\'s learning rate '
                     'in stage 1.')
  flags.DEFINE_float('learning_rate_scale', 0.1, 'Stage 2 fine-tunes at '
                     'the source config\'s peak learning rates '
                     '(learning_rate, muon_learning_rate) times this; the '
                     'scratch runs at them.')
  flags.DEFINE_enum('train', 'all', TRAINED, 'What stage 2 trains: the '
                    'whole model, or the attention layers alone '
                    '(config.trained_params).')
  flags.DEFINE_list('options', [], 'Variant options as variant.option=value '
                    'items, e.g. local.window=64.')
  flags.DEFINE_list('model', [], 'config.model keys of a variant as '
                    'variant.key=value items, e.g. linear.position=none '
                    '(a kernelised attention takes no ALiBi bias).')
  flags.DEFINE_integer('eval_every', None, 'Evaluate stage 2 and the scratch '
                       'runs every this many steps (default: a quarter of '
                       '--steps).')
  flags.mark_flags_as_required(['from', 'variants', 'workdir', 'steps'])


if __name__ == '__main__':
  cli.run(main, _define_flags)
