"""Which parameters weight decay reaches.

The rule: every weight is decayed (kernels, embeddings, the experts and
their router, position tables and projections, T5's table of logit biases
per distance bucket among them, Linformer's projections,
convolution kernels, learned vectors such as a [CLS] token); biases, of
whatever rank, and normalisation scales are not: they set an offset or a
gain, and pulling them to zero does not regularise (as in BERT and GPT-2's
AdamW, Loshchilov & Hutter 2019). A parameter is decayed unless it is
declared with `undecayed(init, names)` in place of
`nn.with_logical_partitioning(init, names)`: the declaration says what it
is, so a new weight is decayed without a list to extend.
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax


class Undecayed(nn.LogicallyPartitioned):
  """A parameter, with its logical axis names, that weight decay leaves
  alone: a bias or a normalisation scale."""


def undecayed(init: Callable[..., jax.Array], names: tuple[str | None, ...]
              ) -> Callable[..., Undecayed]:
  """`init`, its parameter carrying the logical axis `names` and marked as
  not decayed."""
  def boxed_init(*args, **kwargs) -> Undecayed:
    return Undecayed(init(*args, **kwargs), names)
  return boxed_init


def decay_mask(boxed_params) -> Any:
  """True for each parameter weight decay reaches, in the tree of the
  unboxed parameters. `boxed_params`: the parameters (or their shapes) as
  `init` made them, before nn.meta.unbox."""
  return jax.tree.map(
      lambda leaf: not isinstance(leaf, Undecayed), boxed_params,
      is_leaf=lambda leaf: isinstance(leaf, nn.meta.AxisMetadata))
