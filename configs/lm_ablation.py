r"""The second search's winner (configs/lm_stdlib.py:round2, the default
this ablation measured) with each training technique of that search
turned, alone, to its other value (lm_stdlib.OPTIONS): one row per option,
at the default's budget. The third search's ablation is a table of
speedrun rows (experiments/results/lm_ablation3/). Nothing
else changes: the row of the other optimizer runs at the default's
learning rates, not ones tuned for it. Two more rows run the default
at other seeds (initialisation, data order, dropout): the spread an
option's row must exceed to mean anything.

  python -m experiments.sweep --config=configs/lm_ablation.py \
      --workdir=workdirs/lm_ablation --parallel=2

Results: docs/experiments.md, `lm_ablation.py`.
"""

from configs import lm_stdlib


def get_config(arg: str = ''):
  """The second search's winner, configs/lm_stdlib.py:round2 (no
  argument)."""
  if arg:
    raise ValueError(f'configs/lm_ablation.py takes no argument, got {arg!r}.')
  return lm_stdlib.get_config('round2')


def _value(config, key: str):
  for part in key.split('.'):
    config = config[part]
  return config


# The default's rows at other seeds.
SEEDS = (1, 2)


def get_sweep():
  """The default, then each option of lm_stdlib.OPTIONS alone at the value
  the default does not have, then the default at each of SEEDS."""
  config = get_config()
  rows = [{}]
  for key, values in lm_stdlib.OPTIONS.items():
    rows.append({key: values[1 - values.index(_value(config, key))]})
  return rows + [{'seed': seed} for seed in SEEDS]
