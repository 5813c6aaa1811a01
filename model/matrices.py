"""Which parameters are hidden matrices, and which of their axes are the
matrix's inputs and outputs: the parameters an optimizer that acts on
matrices (Muon, Jordan et al. 2024; train/program/optim.py) updates, the
rest being left to an elementwise one.

The rule, read from each parameter's declaration:
- A hidden matrix is a weight (weight decay reaches it: model/weight_decay.py)
  whose logical axes are all hidden features (embed, heads, kv_heads, kv,
  mlp, latent) but for leading stacking axes (expert, one matrix per expert;
  layers, one per group of a scanned stack), and
  which reads or writes a vector of the model's width (one of its axes is
  embed: the residual stream, or DeBERTa's relative position embeddings).
  Attention's per-head projections are the matrices [D, H * K] and
  [H * K, D] they are; each expert's MLP is its own.
- Its inputs are `embed` when that is its first matrix axis (it reads such
  a vector: queries, keys, values, the MLP's first layer), else its other
  matrix axes, `embed` being its output (it writes one: attention's output,
  the MLP's second layer).
- Everything else is not: embeddings and the output head (vocab), position
  tables and attention variants' own parameters (axes no hidden feature
  names, or none), routers and classifiers (an unnamed output axis), biases,
  scales and other vectors.
- Parameters declared without logical names (the RNN baseline's, made by
  flax's Dense, Embed and cells) are read by flax's own names: a 2-D
  `kernel` is a matrix [inputs, outputs]; anything else (its `embedding`
  table, vectors) is not.
"""

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax

from model.attention.core.logical_axes import LATENT, LAYERS
from model.weight_decay import Undecayed

# Axes of the residual stream and the features read from or written to it.
_EMBED = 'embed'
_FEATURES = frozenset({_EMBED, 'heads', 'kv_heads', 'kv', 'mlp', LATENT})
# Axes along which one parameter stacks matrices of the same kind: one per
# expert, one per group of a scanned stack's blocks.
_STACKS = frozenset({'expert', LAYERS})


class Matrix(NamedTuple):
  """A parameter's axes (by position) that a matrix's rows (inputs,
  contracted with the activations) and columns (outputs) flatten; any other
  axis stacks independent matrices. Field names follow optax's
  MuonDimensionNumbers."""

  reduction_axis: tuple[int, ...]
  output_axis: tuple[int, ...]

  def sizes(self, shape: tuple[int, ...]) -> tuple[int, int]:
    """(inputs, outputs): the rows and columns of each matrix that a
    parameter of `shape` stacks."""
    return (math.prod(shape[axis] for axis in self.reduction_axis),
            math.prod(shape[axis] for axis in self.output_axis))


def _of_names(names: tuple[str | None, ...]) -> Matrix | None:
  """The matrix a weight with logical axes `names` is, or None."""
  stacks = 0
  while stacks < len(names) and names[stacks] in _STACKS:
    stacks += 1
  features = names[stacks:]
  if (len(features) < 2 or _EMBED not in features
      or not set(features) <= _FEATURES):
    return None
  axes = range(stacks, len(names))
  if features[0] == _EMBED:
    return Matrix((stacks,), tuple(axes)[1:])
  embed = stacks + features.index(_EMBED)
  return Matrix(tuple(a for a in axes if a != embed), (embed,))


def _of_leaf(path, leaf) -> Matrix | None:
  if isinstance(leaf, Undecayed):
    return None
  if isinstance(leaf, nn.meta.AxisMetadata):
    return _of_names(tuple(leaf.names))
  if path[-1].key == 'kernel' and len(leaf.shape) == 2:
    return Matrix((0,), (1,))
  return None


def is_entry(leaf) -> bool:
  """Whether `leaf` is an entry of hidden_matrices' tree (a Matrix or
  None): the `is_leaf` of tree functions that read that tree."""
  return leaf is None or isinstance(leaf, Matrix)


def hidden_matrices(boxed_params) -> Any:
  """A Matrix for each hidden matrix and None for every other parameter,
  in the tree of the unboxed parameters. `boxed_params`: the parameters (or
  their shapes) as `init` made them, before nn.meta.unbox."""
  return jax.tree_util.tree_map_with_path(
      _of_leaf, boxed_params,
      is_leaf=lambda leaf: isinstance(leaf, nn.meta.AxisMetadata))
