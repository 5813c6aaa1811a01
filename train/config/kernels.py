"""The kernel each self-attention of a config's model runs in training, as
model/attention/kernels/fused.py recorded the choices while the config check
traced the model on the task's synthetic batch under the run's mesh and
logical axis rules (train/config/layout.py's trace_model): the check
refuses a kernel named in `config.model.attention_options` that cannot
compute what a layer asks of it, and the trainer's first lines say what
runs, from one record of the calls training makes.

Cached decoding (a query at a time against a key/value cache, under a mask
array) always takes 'auto': no fused kernel reads a cache.
"""

from collections.abc import Callable
import dataclasses

from model import layer_stack
from model.attention.core import logical_axes
from model.attention.kernels import fused
from train.base.train_config import TrainConfig

# (attention, option) -> the config key that set it, as it was typed
# (model/attention/options.py: option_key).
KeyOf = Callable[[str, str], str]
# The Pallas kernels a CPU runs in Pallas's interpreter: exact, slow.
_INTERPRETED_ON_CPU = ('pallas_tpu', 'pallas_gpu')


def _where(config: TrainConfig, caller: tuple[str, ...]
           ) -> tuple[str, tuple[int, ...]]:
  """(the stack, its layers) of an attention module's path, e.g.
  ('decoder', 'block_0', 'self_attention') -> ('decoder', (0,)); under
  scan_layers, a block of the group the loop repeats is every layer in its
  place, ('decoder', 'layers', 'block_1', ...) -> ('decoder', (1, 3, ...)).
  A path with no block (no model calls one so today) has no layer, read as
  layer 0's attention."""
  for index, name in enumerate(caller):
    block = layer_stack.block_number(name)
    if block is not None:
      if index and caller[index - 1] == logical_axes.LAYERS:
        model = config.model
        return ('/'.join(caller[:index - 1]) or 'model',
                tuple(range(model.scan_start + block, model.num_layers,
                            model.scan_group)))
      return '/'.join(caller[:index]) or 'model', (block,)
  return '/'.join(caller) or 'model', ()


def _attention(config: TrainConfig, layers: tuple[int, ...]) -> str:
  """The attention of `layers` (all alike), or layer 0's for none."""
  return config.model.for_layer(layers[0] if layers else 0).attention


def refusals(config: TrainConfig, decisions: tuple[fused.Decision, ...],
             key_of: KeyOf) -> list[str]:
  """One line for each kernel option that cannot compute what a layer asks
  of it, naming the key as it was typed."""
  found = []
  for decision in decisions:
    if decision.refusal:
      stack, layers = _where(config, decision.caller)
      found.append(
          f'{key_of(_attention(config, layers), "kernel")}='
          f'{decision.option!r} '
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
    packed rows, window 128)'; a Pallas kernel on the CPU is said to run
    interpreted."""
    where = ('' if not self.layers else f' layer {self.layers[0]}'
             if len(self.layers) == 1 else
             f' layers {",".join(map(str, self.layers))}')
    how = 'auto' if self.option == 'auto' else 'as set'
    interpreted = (self.case.backend == 'cpu'
                   and self.kernel in _INTERPRETED_ON_CPU)
    return (f'{self.stack}{where} {self.attention}: {self.kernel} '
            f'({how}; {self.case.describe()}'
            + ('; interpreted on the CPU: slow, for tests' * interpreted)
            + ')')


def grouped(config: TrainConfig,
            decisions: tuple[fused.Decision, ...]) -> list[Layers]:
  """The decisions of a trace, a Layers for each group of layers of a
  stack that ask the same and get the same, in call order."""
  groups: dict[tuple, list[int]] = {}
  for decision in decisions:
    stack, where = _where(config, decision.caller)
    attention = _attention(config, where)
    layers = groups.setdefault((stack, attention, decision.option,
                                decision.kernel, decision.case), [])
    layers.extend(layer for layer in where if layer not in layers)
  return [Layers(stack, tuple(sorted(layers)), attention, option, kernel,
                 case)
          for (stack, attention, option, kernel, case), layers
          in groups.items()]
