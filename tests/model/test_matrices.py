"""The hidden matrices (model/matrices.py) of every family, MoE, attention
variant and position scheme, and Muon's partition of the parameters: each
one is updated by exactly one of Muon and AdamW."""

import flax.linen as nn
import jax
import optax
import pytest

from model.matrices import Matrix, hidden_matrices, is_entry
from tests.helpers.declared_params import CONFIGS, boxed_params
from train.base.train_config import TrainConfig
from train.program import optim

# The projections of attention (DeBERTa's of positions among them) and of
# the MLPs, and the RNN baseline's dense and cell kernels, by the names
# their layers give them: the reference the declarations are checked
# against.
_INTO_HEADS = Matrix((0,), (1, 2))   # [D, H, K] -> [D, H * K]
_OUT_OF_HEADS = Matrix((0, 1), (2,))  # [H, K, D] -> [H * K, D]
_DENSE = Matrix((0,), (1,))           # [inputs, outputs]
_EXPERTS = Matrix((1,), (2,))         # [E, inputs, outputs]


def expected(path: tuple[str, ...], family: str) -> Matrix | None:
  """The matrix; a scanned stack's stacks one per group of blocks along
  its first axis."""
  matrix = _unstacked(path, family)
  if matrix is None or 'layers' not in path:
    return matrix
  return Matrix(*(tuple(axis + 1 for axis in axes) for axes in matrix))


def _unstacked(path: tuple[str, ...], family: str) -> Matrix | None:
  module, name = ((None,) + path)[-2:]
  if family == 'rnn_attention':
    return _DENSE if name == 'kernel' else None
  if name == 'kernel' and module in ('query', 'key', 'value'):
    return _INTO_HEADS
  if module == 'disentangled' and name in ('query_position', 'key_position'):
    return _INTO_HEADS
  if module == 'latent':  # Latent attention's: those that read x [D].
    return {'query': _INTO_HEADS, 'kv_down': _DENSE, 'q_down': _DENSE,
            'rope_key': _DENSE}.get(name)
  if name == 'kernel' and module == 'out':
    return _OUT_OF_HEADS
  if name == 'kernel' and module in ('wi', 'wi_gate', 'wo'):
    return _DENSE
  if module == 'moe' and name in ('wi', 'wi_gate', 'wo'):
    return _EXPERTS
  return None


@pytest.mark.parametrize('name', CONFIGS)
def test_hidden_matrices_are_the_projections_of_attention_and_mlps(name):
  config = CONFIGS[name]
  matrices = hidden_matrices(boxed_params(config))
  found = set()
  for path, matrix in jax.tree_util.tree_leaves_with_path(
      matrices, is_leaf=is_entry):
    keys = tuple(entry.key for entry in path)
    assert matrix == expected(keys, config.family), keys
    found.add(matrix is not None)
  assert found == {True, False}


def _updated(state, params) -> dict[str, set[str]]:
  """The parameters (by path) each partition of Muon's optimizer keeps
  momentum for."""
  partitions = next(s for s in state if isinstance(s, optax.PartitionState))
  muon = partitions.inner_states['muon'].inner_state[0].mu
  adamw = partitions.inner_states['adamw'].inner_state[0].mu
  masked = lambda leaf: isinstance(leaf, optax.MaskedNode)
  return {
      label: {jax.tree_util.keystr(path)
              for path, leaf in jax.tree_util.tree_leaves_with_path(
                  moments, is_leaf=masked) if not masked(leaf)}
      for label, moments in (('muon', muon), ('adamw', adamw))
  } | {'all': {jax.tree_util.keystr(path)
               for path, _ in jax.tree_util.tree_leaves_with_path(params)}}


@pytest.mark.parametrize('name', CONFIGS)
def test_muon_and_adamw_each_update_their_own_parameters(name):
  boxed = boxed_params(CONFIGS[name])
  params = nn.meta.unbox(boxed)
  optimizer, _ = optim.make_optimizer(TrainConfig(optimizer='muon'), boxed)
  updated = _updated(jax.eval_shape(optimizer.init, params), params)
  assert updated['muon'] | updated['adamw'] == updated['all']
  assert not updated['muon'] & updated['adamw']
  matrices = {
      jax.tree_util.keystr(path) for path, matrix
      in jax.tree_util.tree_leaves_with_path(hidden_matrices(boxed),
                                             is_leaf=is_entry)
      if matrix is not None}
  assert updated['muon'] == matrices
