"""The kernel each self-attention of a config's model runs in training, as
model/attention/fused.py recorded the choices while the config check
traced the model on the task's synthetic batch under the run's mesh and
logical axis rules (train/config/layout.py's trace_model): the check
refuses a kernel named in `config.model.attention_options` that cannot
compute what a layer asks of it, and the trainer's first lines say what
runs, from one record of the calls training makes.

Cached decoding (a query at a time against a key/value cache, under a mask
array) always takes 'auto': no fused kernel reads a cache.
"""

import dataclasses

from model.attention import fused
from train.base.train_config import TrainConfig


def _where(caller: tuple[str, ...]) -> tuple[str, int | None]:
  """(the stack, the layer) of an attention module's path, e.g.
  ('decoder', 'block_0', 'self_attention') -> ('decoder', 0); a path with
  no block (no model calls one so today) is layer None, read as layer 0's
  attention."""
  for index, name in enumerate(caller):
    if name.startswith('block_') and name[len('block_'):].isdigit():
      return '/'.join(caller[:index]) or 'model', int(name[len('block_'):])
  return '/'.join(caller) or 'model', None


def _key(config: TrainConfig, decision: fused.Decision) -> str:
  """The config key of the kernel option a decision read."""
  _, layer = _where(decision.caller)
  attention = config.model.for_layer(layer or 0).attention
  return config.model.option_key(attention, 'kernel')


def refusals(config: TrainConfig,
             decisions: tuple[fused.Decision, ...]) -> list[str]:
  """One line for each kernel option that cannot compute what a layer asks
  of it, naming the key."""
  found = []
  for decision in decisions:
    if decision.refusal:
      stack, _ = _where(decision.caller)
      found.append(
          f'{_key(config, decision)}={decision.option!r} '
          f"{decision.refusal}: the {stack}'s self-attention is "
          f'{decision.case.describe()} on {decision.case.backend}; set it '
          "to 'auto'.")
  return list(dict.fromkeys(found))  # The layers of a stack ask alike.


@dataclasses.dataclass(frozen=True)
class Layers:
  """The layers of a stack whose self-attention asks the same of a kernel
  and gets the same."""

  stack: str  # e.g. 'decoder' or 'encoder'.
  layers: tuple[int, ...]
  attention: str
  option: str  # The kernel option ('auto' unset).
  kernel: str | None  # What runs; None where the option refuses the case.
  case: fused.Case

  def describe(self) -> str:
    """e.g. 'decoder layers 0,2 local: pallas_tpu (auto; bfloat16, causal,
    packed rows, window 128)'."""
    where = ('' if not self.layers else f' layer {self.layers[0]}'
             if len(self.layers) == 1 else
             f' layers {",".join(map(str, self.layers))}')
    how = 'auto' if self.option == 'auto' else 'as set'
    return (f'{self.stack}{where} {self.attention}: {self.kernel} '
            f'({how}; {self.case.describe()})')


def grouped(config: TrainConfig,
            decisions: tuple[fused.Decision, ...]) -> list[Layers]:
  """The decisions of a trace, a Layers for each group of layers of a
  stack that ask the same and get the same, in call order."""
  groups: dict[tuple, list[int]] = {}
  for decision in decisions:
    stack, layer = _where(decision.caller)
    attention = config.model.for_layer(layer or 0).attention
    layers = groups.setdefault((stack, attention, decision.option,
                                decision.kernel, decision.case), [])
    if layer is not None and layer not in layers:
      layers.append(layer)
  return [Layers(stack, tuple(layers), attention, option, kernel, case)
          for (stack, attention, option, kernel, case), layers
          in groups.items()]
