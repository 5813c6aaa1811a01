"""Muon's direction (Jordan et al. 2024) for the hidden matrices: Nesterov
momentum, orthogonalised by Newton-Schulz steps, with every matrix of one
shape orthogonalised in one batched iteration.

A model's hidden matrices come in a few shapes (attention's [D, H * K] and
[H * K, D], the MLP's [D, F] and [F, D], each expert's). Orthogonalised
one by one, as optax's scale_by_muon does, each costs its own fifteen
small matmuls: about 360 GEMM kernels a step for `make train`'s 4-layer
model, which a GPU runs one after another (experiments/results/
accelerator_report/h200_round_two/). Here each matrix is flattened to
[inputs, outputs] (model/matrices.py's Matrix) and turned to have no more
rows than columns (the iteration commutes with transposition), those of
one shape are stacked, and the iteration (optax's arithmetic) runs once
per shape on the stack: a handful of batched matmuls.
"""

from collections import defaultdict
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from model.matrices import Matrix

# The quintic's coefficients (a, b, c) and step count of optax's
# scale_by_muon: X <- a X + b (X X^T) X + c (X X^T)^2 X.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


class MuonState(NamedTuple):
  """The step count, each matrix's momentum and the quintic's coefficients
  (the fields of optax's MuonState, whose checkpoints therefore restore)."""
  count: jax.Array  # int32 [].
  mu: optax.Updates
  ns_coeffs: jax.Array  # float32 [3]: NS_COEFFICIENTS.


def _order(ndim: int, matrix: Matrix) -> list[int]:
  """A parameter's axes as [stacking axes, inputs, outputs]."""
  flat = matrix.reduction_axis + matrix.output_axis
  return ([axis for axis in range(ndim) if axis not in flat]
          + list(matrix.reduction_axis) + list(matrix.output_axis))


def _flatten(x: jax.Array, matrix: Matrix) -> jax.Array:
  """`x` as [stacked matrices, inputs, outputs]."""
  return x.transpose(_order(x.ndim, matrix)).reshape(-1, *matrix.sizes(
      x.shape))


def _unflatten(y: jax.Array, like: jax.Array, matrix: Matrix) -> jax.Array:
  """`_flatten`'s inverse: `y` [stacked, inputs, outputs] in the layout of
  `like`."""
  order = _order(like.ndim, matrix)
  return y.reshape([like.shape[axis] for axis in order]).transpose(
      [order.index(axis) for axis in range(like.ndim)])


def newton_schulz(x: jax.Array, coefficients: jax.Array, *,
                  steps: int = NS_STEPS, eps: float = 1e-8) -> jax.Array:
  """x [matrices, rows, columns] (rows <= columns), each matrix divided
  by its Frobenius norm, then `steps` quintic Newton-Schulz steps with
  `coefficients` [3] (a, b, c): an approximation of U V^T for
  X = U S V^T whose singular values land roughly in [0.7, 1.2] (Jordan
  et al. 2024)."""
  a, b, c = coefficients.astype(x.dtype)
  x = x / (jnp.sqrt(jnp.sum(x * x, axis=(1, 2), keepdims=True)) + eps)
  for _ in range(steps):
    gram = x @ x.mT
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x


def orthogonalise(updates: list[jax.Array], matrices: list[Matrix],
                  coefficients: jax.Array) -> list[jax.Array]:
  """Each update's matrices (as `matrices` says) replaced by
  `newton_schulz` of them, all matrices of one shape and dtype in one
  batched iteration."""
  # (rows, columns, dtype): [(index, wide, whether it was turned)].
  groups = defaultdict(list)
  for index, (update, matrix) in enumerate(zip(updates, matrices,
                                               strict=True)):
    flat = _flatten(update, matrix)
    # No more rows than columns, so that X X^T is the smaller Gram matrix;
    # the iteration commutes with transposition.
    tall = flat.shape[1] > flat.shape[2]
    wide = flat.mT if tall else flat
    groups[wide.shape[1:] + (wide.dtype,)].append((index, wide, tall))
  result = [None] * len(updates)
  for members in groups.values():
    done = newton_schulz(jnp.concatenate([wide for _, wide, _ in members]),
                         coefficients)
    ends = list(itertools.accumulate(wide.shape[0] for _, wide, _ in members))
    for (index, _, tall), part in zip(members, jnp.split(done, ends[:-1])):
      result[index] = _unflatten(part.mT if tall else part, updates[index],
                                 matrices[index])
  return result


def scale_by_muon(matrices, *, beta: float) -> optax.GradientTransformation:
  """Muon's direction for each update: its Nesterov momentum (optax's
  bias-corrected form) orthogonalised (`orthogonalise`). `matrices`: the
  Matrix of each leaf the updates hold (optax.MaskedNode elsewhere)."""
  is_matrix = lambda leaf: isinstance(leaf, Matrix)

  def init_fn(params):
    return MuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params),
                     jnp.asarray(NS_COEFFICIENTS))

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    nesterov = jax.tree.map(
        lambda m, g: beta * m + (1 - beta) * g,
        optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
        optax.tree.bias_correction(updates, beta, count))
    leaves, structure = jax.tree.flatten(nesterov)
    directions = orthogonalise(
        leaves, jax.tree.leaves(matrices, is_leaf=is_matrix), state.ns_coeffs)
    return (structure.unflatten(directions),
            MuonState(count, mu, state.ns_coeffs))

  return optax.GradientTransformation(init_fn, update_fn)


class NeuronNormState(NamedTuple):
  """Each hidden matrix's running mean square of its direction per output
  unit (neuron), [stacked matrices, outputs] in the order of the
  matrices' leaves: a tuple, not the parameters' tree, so that it is
  placed whole on every device (it is a vector per matrix)."""
  nu: tuple[jax.Array, ...]


def normalise_neurons(matrices, *, beta: float, eps: float = 1e-10
                      ) -> optax.GradientTransformation:
  """NorMuon's step after Muon's direction (Li et al. 2025): each output
  unit's part of an orthogonalised update O [inputs, outputs] divided by
  the root of its running mean square nu (nu <- beta nu + (1 - beta) *
  mean over inputs of O^2), then the matrix scaled back to O's Frobenius
  norm (as modded-nanogpt does), so that Muon's learning rate keeps its
  meaning. `matrices`: the Matrix of each leaf (optax.MaskedNode
  elsewhere)."""
  is_matrix = lambda leaf: isinstance(leaf, Matrix)

  def init_fn(params):
    def zeros(leaf, matrix):
      inputs, outputs = matrix.sizes(leaf.shape)
      return jnp.zeros((leaf.size // (inputs * outputs), outputs),
                       jnp.float32)
    return NeuronNormState(tuple(
        zeros(leaf, matrix) for leaf, matrix in zip(
            jax.tree.leaves(params),
            jax.tree.leaves(matrices, is_leaf=is_matrix), strict=True)))

  def normalise(update, nu, matrix):
    flat = _flatten(update, matrix).astype(jnp.float32)
    nu = beta * nu + (1 - beta) * jnp.mean(flat * flat, axis=1)
    scaled = flat * jax.lax.rsqrt(nu + eps)[:, None, :]
    norm = lambda x: jnp.sqrt(jnp.sum(x * x, axis=(1, 2), keepdims=True))
    scaled = scaled * (norm(flat) / (norm(scaled) + eps))
    return _unflatten(scaled.astype(update.dtype), update, matrix), nu

  def update_fn(updates, state, params=None):
    del params
    leaves, structure = jax.tree.flatten(updates)
    done = [normalise(update, nu, matrix) for update, nu, matrix in zip(
        leaves, state.nu, jax.tree.leaves(matrices, is_leaf=is_matrix),
        strict=True)]
    return (structure.unflatten([update for update, _ in done]),
            NeuronNormState(tuple(nu for _, nu in done)))

  return optax.GradientTransformation(init_fn, update_fn)
