r"""The length-generalisation study: which position scheme carries an
encoder-decoder trained on inputs of up to 40 symbols to inputs of 400.

  python -m experiments.length_generalisation \
      --workdir=workdirs/length_generalisation [--parallel=1] \
      [--out=experiments/results/length_generalisation]

Runs the sweep of configs/length_generalisation.py (every position scheme
on copy, reverse and addition; a cell that finished is not run again and an
interrupted one resumes, so the command can be run in several sittings),
then reads what each cell's final evaluation decoded (DIR/<cell>/decoded/,
greedy, the first inputs of `validation` and of `long`) and scores it by
input length. Writes results.md, results.csv and length_generalisation.png
to --out (default: a fresh folder of workdirs/): exact match and
per-token (character) accuracy in length buckets, and the published
figures of Dehghani et al. (2019) at length 400.
"""

import os
import time

from absl import flags
import matplotlib

from experiments import common, sweep, trials
from train import cli
from train.base.errors import InputError
from train.decode import scores, seq2seq_eval

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)

FLAGS = flags.FLAGS
CONFIG = 'configs/length_generalisation.py'

# Input lengths (symbols, without the end token), inclusive: the training
# lengths (validation), then those of the long split.
BUCKETS = ((1, 20), (21, 40), (41, 100), (101, 200), (201, 300), (301, 400))
SPLITS = ('validation', 'long')

# Dehghani et al. 2019 (Universal Transformers), the algorithmic tasks:
# trained on inputs of up to 40 symbols, tested on 400. Per-character
# accuracy (sequence accuracy where published here).
ANCHORS = {
    'Transformer': {'copy': 0.53, 'reverse': 0.13, 'addition': 0.07},
    'Universal Transformer': {'copy': 0.91, 'reverse': 0.96,
                              'addition': 0.34},
}
ANCHOR_SEQUENCE_ACCURACY = {'Transformer': {'copy': 0.03, 'reverse': 0.06,
                                            'addition': 0.00}}
ANCHOR_LENGTH = 400


def input_length(inputs: list[int]) -> int:
  """Symbols of an input (its ids without the end token)."""
  return len(seq2seq_eval.until_eos(inputs)) - 1


def by_length(examples: list[dict], buckets=BUCKETS) -> list[dict]:
  """Exact match, token accuracy and the mean ratio of the output's length
  to the reference's (end tokens included) of the decoded `examples` (as
  seq2seq_eval.read_decoded gives them) in each bucket of input lengths
  that holds any: {'lengths': 'a-b', 'examples', 'exact_match',
  'token_accuracy', 'length_ratio'}."""
  rows = []
  for low, high in buckets:
    inside = [e for e in examples
              if low <= input_length(e['inputs']) <= high]
    if not inside:
      continue
    hypotheses = [e['hypothesis'] for e in inside]
    references = [e['reference'] for e in inside]
    rows.append({'lengths': f'{low}-{high}', 'examples': len(inside),
                 'exact_match': scores.exact_match(hypotheses, references),
                 'token_accuracy': scores.token_accuracy(hypotheses,
                                                         references),
                 'length_ratio': sum(len(h) / len(r) for h, r in zip(
                     hypotheses, references)) / len(inside)})
  return rows


def cell_rows(workdir: str, cell: dict) -> list[dict]:
  """The scores of one finished cell: per split, one row over all its
  inputs (lengths 'all'), then one per bucket."""
  name = trials.trial_name(cell)
  rows = []
  for split in SPLITS:
    path = os.path.join(workdir, name, 'decoded', f'{split}.jsonl')
    if not os.path.exists(path):
      raise InputError(f'{path} is missing: the cell {name} finished without '
                       'decoding; run it again in a new --workdir.')
    examples = seq2seq_eval.read_decoded(path)
    overall = by_length(examples, [(0, float('inf'))])
    overall[0]['lengths'] = 'all'
    rows += [{'task': cell['dataset_options.task'],
              'position': cell['model.position'], 'split': split, **row}
             for row in overall + by_length(examples)]
  return rows


def plot(rows: list[dict], tasks: list[str], positions: list[str],
         path: str) -> None:
  """Token accuracy against input length, one panel per task, one line
  per position scheme, the published figures at length 400."""
  figure, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks) + 3.5,
                                                     4),
                              squeeze=False, sharey=True)
  bucketed = {(r['task'], r['position'], r['lengths']): r for r in rows}
  for ax, task in zip(axes[0], tasks):
    for position in positions:
      points = []
      for low, high in BUCKETS:
        row = bucketed.get((task, position, f'{low}-{high}'))
        if row:
          points.append(((low + high) / 2, row['token_accuracy']))
      if points:
        ax.plot(*zip(*points), marker='o', markersize=3, label=position)
    for (model, figures), marker in zip(ANCHORS.items(), ('X', '*')):
      ax.scatter([ANCHOR_LENGTH], [figures[task]], marker=marker, s=120,
                 color='black', zorder=3,
                 label=f'{model} (Dehghani et al. 2019)')
    ax.axvline(BUCKETS[1][1] + 0.5, color='grey', linestyle=':',
               linewidth=1, label='longest trained')
    ax.set(title=task, xlabel='input length (symbols, bucket midpoints)',
           ylim=(0, 1.02))
  axes[0][0].set_ylabel('per-token accuracy')
  handles = {}
  for ax in axes[0]:
    handles |= dict(zip(*reversed(ax.get_legend_handles_labels())))
  figure.legend(handles.values(), handles.keys(), fontsize=8,
                loc='center right')
  figure.tight_layout(rect=(0, 0, 1 - 3.5 / figure.get_figwidth(), 1))
  figure.savefig(path, dpi=120)
  plt.close(figure)


def report(workdir: str, out: str, command: str) -> str:
  """Writes to `out` the scores of the finished cells: results.md and
  results.csv (one row per cell), buckets.md and buckets.csv (every split
  and bucket) and the plot; returns the results table."""
  cells = trials.load_sweep(CONFIG)
  rows, missing, seconds = [], [], 0.0
  for cell in cells:
    record = common.load_json(os.path.join(
        workdir, trials.trial_name(cell), 'trial.json'))
    if record is None or record['status'] != 'finished':
      missing.append(trials.trial_name(cell))
      continue
    rows += cell_rows(workdir, cell)
    seconds += record.get('seconds', 0.0)
  if not rows:
    raise InputError(f'{workdir} holds no finished cell of {CONFIG}.')
  tasks = list(dict.fromkeys(c['dataset_options.task'] for c in cells))
  positions = list(dict.fromkeys(c['model.position'] for c in cells))
  os.makedirs(out, exist_ok=True)
  plot(rows, tasks, positions, os.path.join(out, 'length_generalisation.png'))
  common.write_table(rows, ['task', 'position', 'split', 'lengths',
                            'examples', 'exact_match', 'token_accuracy',
                            'length_ratio'],
                     os.path.join(out, 'buckets'),
                     '# Every split and length bucket of each cell\n\n')
  long_buckets = [f'{low}-{high}' for low, high in BUCKETS
                  if low > BUCKETS[1][1]]
  at = {(r['task'], r['position'], r['split'], r['lengths']): r
        for r in rows}
  summary = []
  for task in tasks:
    for position in positions:
      if (task, position, 'long', 'all') not in at:
        continue
      validation = at[task, position, 'validation', 'all']
      long = at[task, position, 'long', 'all']
      summary.append({
          'task': task, 'position': position,
          'validation exact': validation['exact_match'],
          'validation tokens': validation['token_accuracy'],
          **{lengths: at[task, position, 'long', lengths]['token_accuracy']
             for lengths in long_buckets
             if (task, position, 'long', lengths) in at},
          'long exact': long['exact_match'],
          'long tokens': long['token_accuracy'],
          'long length ratio': long['length_ratio']})
  anchors = '\n'.join(
      f'- {model}: ' + ', '.join(
          f'{task} {figures[task]:.2f}'
          + (f' ({ANCHOR_SEQUENCE_ACCURACY[model][task]:.2f} exact)'
             if model in ANCHOR_SEQUENCE_ACCURACY else '')
          for task in tasks)
      for model, figures in ANCHORS.items())
  preamble = (
      '# Length generalisation: position schemes, trained on 1-40 symbols, '
      'tested to 400\n\n'
      f'    {command}\n\n'
      f'Machine: {common.machine_description()}. The wall times of the '
      f'{len(cells) - len(missing)} cells, training and decoding, add up to '
      f'{seconds / 60:.0f} minutes (with --parallel=N, N ran at once).'
      + (f' Not finished yet: {", ".join(missing)}.' if missing else '')
      + '\n\nEach cell is configs/length_generalisation.py with that task '
      'and position scheme; its final checkpoint decoded greedily the first '
      'inputs of `validation` (the training lengths) and of `long` (41-400 '
      'symbols). "exact" is the fraction of outputs entirely right, '
      '"tokens" the fraction of reference tokens right at their position '
      '(character accuracy); the length columns are the per-token accuracy '
      'on `long` by input length (buckets.csv has every bucket, with its '
      'exact match and count), and "length ratio" the mean ratio of an '
      'output\'s length to its reference\'s: under 1, the model stopped '
      'early.\n\n'
      'Published, at length 400 (Dehghani et al. 2019, per-character '
      'accuracy):\n' + anchors + '\n\n')
  return common.write_table(
      summary, ['task', 'position', 'validation exact', 'validation tokens',
                *long_buckets, 'long exact', 'long tokens',
                'long length ratio'],
      os.path.join(out, 'results'), preamble)


def main(argv: list[str]) -> None:
  def work(out: str):
    started = time.perf_counter()
    workdir = common.local_workdir(FLAGS.workdir)
    sweep.sweep(CONFIG, workdir, parallel=FLAGS.parallel)
    command = ('python -m experiments.length_generalisation '
               f'--workdir={FLAGS.workdir}'
               + (f' --parallel={FLAGS.parallel}' if FLAGS.parallel > 1
                  else '') + (f' --out={FLAGS.out}' if FLAGS.out else ''))
    print(report(workdir, out, command))
    print(f'This sitting: {(time.perf_counter() - started) / 60:.1f} '
          'minutes.')
  common.results_main(argv, 'length_generalisation', work)


def _define_flags() -> None:
  """The command line, defined only when this runs as a script."""
  flags.DEFINE_string('workdir', None, 'Directory of the study\'s cells.')
  flags.DEFINE_integer('parallel', 1, 'Cells trained at once.',
                       lower_bound=1)
  common.define_out_flag('length_generalisation')
  flags.mark_flags_as_required(['workdir'])


if __name__ == '__main__':
  cli.run(main, _define_flags)
