"""What the experiment scripts share: their flags' values checked, where
their results go, config overrides, a run's metrics, result tables and
plots, and a description of the machine."""

import ast
from collections.abc import Callable, Iterable, Sequence
import copy
import csv
import json
import os
import platform
import re
import time
from typing import Any

from absl import flags
import jax
import matplotlib
import matplotlib.ticker
import numpy as np

from model import attention
from model.attention import options as variant_options
from train import cli
from train.base import storage
from train.base.errors import InputError, did_you_mean
from train.run import metrics

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)

# The flags defined here (define_out_flag) are the calling script's: its
# --help lists them.
flags.disclaim_key_flags()


def parse_value(text: str) -> Any:
  """A command-line value as a Python literal where it is one (3, 1e-3,
  True, 'x', (1, 2)), else the text itself."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def parse_integers(flag: str, items: list[str]) -> list[int]:
  """The positive integers of a list flag; InputError naming the flag."""
  try:
    values = [int(item) for item in items]
  except ValueError:
    values = []
  if len(values) < len(items) or any(value < 1 for value in values):
    raise InputError(f'{flag}={",".join(items)} must be positive integers.')
  return values


def check_variant(flag: str, name: str) -> None:
  """InputError naming `flag` unless `name` is a registered attention."""
  known = attention.names()
  if name not in known:
    raise InputError(f'{flag}: no attention variant {name!r}'
                     f'{did_you_mean(name, known)} The variants: '
                     f'{", ".join(known)}.')


def check_among(flag: str, named: Iterable[str], variants: list[str]
                ) -> None:
  """InputError naming `flag` for a variant it `named` (settings given by
  variant.key=value) that is not among `variants`."""
  for name in named:
    if name not in variants:
      raise InputError(f'{flag}: {name!r} is not among --variants='
                       f'{",".join(variants)}.')


def check_options(options: dict[str, dict]) -> None:
  """Each variant of --options (as parse_options gives them) is registered
  and takes its options; InputError naming the first that is not."""
  for name, given in options.items():
    check_variant('--options', name)
    known = sorted(variant_options.option_names(name))
    for option in given:
      if option not in known:
        raise InputError(
            f'--options: {name}.{option}: {name} has no option {option!r}'
            f'{did_you_mean(option, known)} Its options: '
            f'{", ".join(known)}.')


def parse_options(items: list[str], flag: str = '--options'
                  ) -> dict[str, dict]:
  """['local.window=32', ...] -> {'local': {'window': 32}, ...}; InputError
  naming `flag` for an item of another form."""
  options = {}
  for item in items:
    name, sep, value = item.partition('=')
    variant, dot, key = name.partition('.')
    if not (sep and dot and key):
      raise InputError(f'{flag} item {item!r} is not variant.key=value.')
    options.setdefault(variant, {})[key] = parse_value(value)
  return options


def parse_overrides(items: list[str]) -> dict[str, str]:
  """--set's key=value items as config overrides (the values as typed);
  InputError naming an item without '='. A comma that the list flag split
  at but that no key follows belongs to a value ('model.attention=
  local,local', 'window_schedule=((300, 64), (600, 128))')."""
  overrides = {}
  for item in re.split(r',(?=[\w.]+=)', ','.join(items)) if items else []:
    key, sep, value = item.partition('=')
    if not sep:
      raise InputError(f'--set item {item!r} is not key=value.')
    overrides[key] = value
  return overrides


def local_workdir(workdir: str) -> str:
  """An experiment's --workdir, absolute; InputError for a URL: its
  tables, plots and trials are files of a directory (a shared one, or a
  bucket mounted with gcsfuse), and only train.train writes a bucket
  itself."""
  if storage.is_object_store(workdir):
    raise InputError(
        f'--workdir={workdir}: an experiment keeps its tables, plots and '
        'trials in a directory (a shared one, or a bucket mounted with '
        'gcsfuse); train.train alone writes to a bucket directly.')
  return storage.resolve(workdir)


def results_folder(out: str | None, experiment: str) -> str:
  """Where an experiment writes its results: `out` (--out) where given,
  the committed results in experiments/results/ only so; else a fresh
  folder of the ignored workdirs/, named for the experiment and the
  time, e.g. workdirs/bench_compile-20260101-120000."""
  if out:
    return out
  stem = os.path.join('workdirs', f'{experiment}-'
                      f'{time.strftime("%Y%m%d-%H%M%S")}')
  path, number = stem, 1
  while os.path.exists(path):  # Another started in the same second.
    number += 1
    path = f'{stem}-{number}'
  return path


def define_out_flag(experiment: str) -> None:
  """Defines an experiment's --out flag, which results_main reads."""
  flags.DEFINE_string(
      'out', None, f'Where the results go; default: a fresh folder '
      f'workdirs/{experiment}-<date>-<time>. The committed ones: '
      f'--out=experiments/results/{experiment}.')


def results_main(argv: list[str], experiment: str,
                 work: Callable[[str], Any]) -> None:
  """The body of an experiment's main (cli.run_main): `work(OUT)`, OUT the
  folder of its results (results_folder of --out), then a line saying
  where they are."""
  out = results_folder(flags.FLAGS['out'].value, experiment)
  cli.run_main(argv, lambda: work(out))
  print(f'Results in {out}.')


def load_json(path: str):
  """The JSON value in `path`, or None if there is no such file."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def save_json(path: str, value) -> None:
  """Writes `value` so that the file is whole or absent, never half."""
  with open(path + '.tmp', 'w') as f:
    json.dump(value, f, indent=2)
  os.replace(path + '.tmp', path)


def read_metrics(workdir: str) -> list[dict[str, float]]:
  """The lines of `workdir/metrics.jsonl` (none if it is missing). A
  resumed run logs again the steps after its checkpoint: of lines logged
  for the same step holding the same kinds of figures (training, or
  evaluation, or both), the last is kept, whatever else either holds (a
  resume's `steps_averaged`, an `mfu` measured elsewhere)."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  lines = metrics.read_metrics(path)
  last = {(line['step'], 'loss' in line, 'eval_loss' in line): i
          for i, line in enumerate(lines)}
  return [lines[i] for i in sorted(last.values())]


def _cell(value) -> str:
  if isinstance(value, float):
    return f'{value:.4g}'
  return '' if value is None else str(value)


def write_table(rows: Sequence[dict[str, Any]], columns: Sequence[str],
                path_stem: str, preamble: str = '') -> str:
  """Writes `path_stem`.csv and `path_stem`.md (the preamble, then the
  table); returns the markdown table."""
  with open(path_stem + '.csv', 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction='ignore')
    writer.writeheader()
    writer.writerows(rows)
  lines = ['| ' + ' | '.join(columns) + ' |',
           '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(_cell(row.get(c)) for c in columns) + ' |'
            for row in rows]
  table = '\n'.join(lines) + '\n'
  with open(path_stem + '.md', 'w') as f:
    f.write(preamble + table)
  return table


def series_style(number: int) -> dict[str, str]:
  """The colour and line style of a plot's `number`-th series: the ten
  colours of matplotlib's cycle, solid, then dashed, then dotted, so that
  no two of up to 30 series look alike."""
  return {'color': f'C{number % 10}',
          'linestyle': ('-', '--', ':')[number // 10 % 3]}


def plot_against_length(
    panels: Sequence[tuple[str, dict[str, list[tuple[int, Any]]]]],
    path: str) -> None:
  """Side-by-side log-log plots, one per (y label, {series: [(length,
  value or None)]}), with O(n) and O(n^2) slopes through the first point
  drawn and ticks at the lengths measured."""
  figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4),
                              squeeze=False)
  for ax, (label, series) in zip(axes[0], panels):
    anchor, lengths = None, set()
    for number, (name, points) in enumerate(series.items()):
      points = [(n, v) for n, v in points if v is not None]
      if points:
        ax.plot(*zip(*points), marker='o', label=name,
                **series_style(number))
        anchor = anchor or points[0]
        lengths |= {n for n, _ in points}
    if anchor:
      n = np.array(sorted(lengths), float)
      for power, style in ((1, ':'), (2, '--')):
        ax.plot(n, anchor[1] * (n / anchor[0]) ** power, 'k' + style,
                linewidth=0.8, label=f'O(n{"²" if power == 2 else ""})')
    ax.set(xscale='log', yscale='log', xlabel='sequence length',
           ylabel=label)
    # Ticks at the lengths measured, as plain numbers.
    ax.set_xticks(sorted(lengths), [str(n) for n in sorted(lengths)])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda value, _: f'{value:g}'))
  if axes[0][0].get_legend_handles_labels()[0]:
    axes[0][0].legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def time_steps(step, state, batch, *, steps: int, warmup: int) -> float:
  """Seconds per `step(state, batch) -> (state, metrics)` over `steps`
  dispatched back to back, after `warmup` (compilation included there)."""
  for _ in range(warmup):
    state, metrics = step(state, batch)
  jax.block_until_ready((state, metrics))
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready((state, metrics))
  return (time.perf_counter() - start) / steps


def timed_run_config(config, *, num_train_steps: int, log_every: int):
  """A copy of `config` for a run timed by its logged steps_per_s:
  `num_train_steps` steps logged every `log_every`, evaluation (one batch)
  and a checkpoint after the last step only, no sample; the learning-rate
  warmup cut to fit (it changes values, not time)."""
  run = copy.deepcopy(config)
  run.update(num_train_steps=num_train_steps, log_every=log_every,
             eval_every=0, checkpoint_every=0, num_eval_steps=1,
             sample_length=0,
             warmup_steps=min(config.warmup_steps, num_train_steps))
  return run


def temp_bytes(jitted, *args) -> int:
  """The temporaries of `jitted` compiled for `args` (XLA's memory
  analysis: what it allocates beyond its arguments and outputs); the
  compiled program is cached, so a call that follows does not compile
  again."""
  return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def machine_description() -> str:
  """One line: processor, cores, JAX backend and devices."""
  processor = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      names = [line.split(':', 1)[1].strip() for line in f
               if line.startswith('model name')]
    processor = names[0] if names else processor
  except OSError:
    pass
  devices = jax.devices()
  return (f'{processor}, {os.cpu_count()} cores; JAX {jax.__version__} on '
          f'{len(devices)} {devices[0].device_kind} device(s)')
