r"""The default byte LM of configs/lm_stdlib.py with each training
technique of its second search turned, alone, to its other value
(lm_stdlib.OPTIONS): one row per option, at the default's budget. Nothing
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
  """The default of configs/lm_stdlib.py (no argument)."""
  if arg:
    raise ValueError(f'configs/lm_ablation.py takes no argument, got {arg!r}.')
  return lm_stdlib.get_config()


def _value(config, key: str):
  for part in key.split('.'):
    config = config[part]
  return config


# The default's rows at other seeds.
SEEDS = (1, 2)


def get_sweep():
  """The default, then each option of lm_stdlib.OPTIONS alone at the value
  the default does not have, then the default at each of SEEDS."""
  config = lm_stdlib.get_config()
  rows = [{}]
  for key, values in lm_stdlib.OPTIONS.items():
    rows.append({key: values[1 - values.index(_value(config, key))]})
  return rows + [{'seed': seed} for seed in SEEDS]
