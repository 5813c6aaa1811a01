"""Where the train state and batches live on the mesh.

Parameters carry logical axis names (embed, heads, kv_heads, kv, mlp, vocab,
length, expert; see model/layers.py, model/moe.py) and the Transformer
blocks constrain their inputs to (activation_batch, activation_length,
activation_embed) (model/attention/core/logical_axes.py); the fused
attention kernels split their work by the same rules.
`config.logical_axis_rules` maps each name to mesh axes
(train/program/mesh.py); a name without a rule is not split. Its defaults
(train/base/train_config.py) give
  data parallelism      the batch over data and fsdp;
  FSDP                  every weight's embed dim over fsdp (each weight
                        matrix and embedding has one);
  tensor parallelism    heads, key/value heads, MLP units and vocabulary
                        over tensor;
  sequence parallelism  activations' length over sequence.
The experts of a mixture-of-experts layer are not split by default; a rule
('expert', 'fsdp') (or 'data') puts a share of them on each device (expert
parallelism), placed before ('embed', 'fsdp') so that it takes the axis.
A rule maps a name to one mesh axis or a tuple of them; for each array,
rules are tried in order and a mesh axis is used at most once.

The programs that use them are built in train/run/program.py.
"""

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model.state import Memory
from train.base.train_config import BATCH_AXES
from train.program.steps import TrainState


def mesh_axes(target) -> tuple[str, ...]:
  """A rule's target as a tuple of mesh axes (None: none)."""
  if target is None:
    return ()
  return (target,) if isinstance(target, str) else tuple(target)


def state_shardings(abstract_state: TrainState, boxed_params, mesh: Mesh,
                    rules, *, replicate_params: bool = False) -> TrainState:
  """Shardings of every leaf of the train state.

  Parameters follow their logical names (or are replicated, for pmap); the
  optimizer's per-parameter statistics (Adam's moments, Muon's momentum)
  follow the parameters; a Transformer-XL memory is split by example like the batch.
  """
  replicated = NamedSharding(mesh, P())
  if replicate_params:
    params = jax.tree.map(lambda _: replicated, abstract_state.params)
  else:
    params = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(boxed_params), mesh, rules)
  structure = jax.tree.structure(abstract_state.params)

  def masked(leaf) -> bool:
    return isinstance(leaf, optax.MaskedNode)

  def like_params(subtree) -> bool:
    """Per-parameter statistics, of every parameter or (optax.partition's
    and optax.masked's) of some, the others masked."""
    return jax.tree.structure(subtree, is_leaf=masked) == structure

  def placed_like_params(subtree):
    return jax.tree.map(lambda leaf, placed: leaf if masked(leaf) else placed,
                        subtree, params, is_leaf=masked)

  opt_state = jax.tree.map(
      lambda subtree: (placed_like_params(subtree) if like_params(subtree)
                       else replicated),
      abstract_state.opt_state, is_leaf=like_params)
  memory = None
  if abstract_state.memory is not None:
    memory = Memory(hidden=NamedSharding(mesh, P(None, BATCH_AXES)),
                    valid=NamedSharding(mesh, P(BATCH_AXES)))
  return TrainState(step=replicated, params=params, opt_state=opt_state,
                    memory=memory)


def batch_sharding(mesh: Mesh, *, stacked: bool = False) -> NamedSharding:
  """Batches (and per-example metrics) are split by example; `stacked`:
  batches [K, B, ...] of several steps (config.steps_per_call), split
  alike."""
  return NamedSharding(mesh, P(None, BATCH_AXES) if stacked
                       else P(BATCH_AXES))


def global_batch(batch, sharding: NamedSharding, rows: int, *,
                 stacked: bool = False):
  """The global arrays of a batch of `rows` rows ([K, rows, ...] where
  `stacked`) of which this host holds its own (`process_rows`) or all:
  each host places the rows of its devices, in one transfer of the whole
  tree on a single host."""
  if jax.process_count() == 1:
    return jax.device_put(batch, sharding)
  lead = 2 if stacked else 1
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(
          sharding, x, x.shape[:lead - 1] + (rows,) + x.shape[lead:]),
      batch)


def process_rows(sharding: NamedSharding, rows: int) -> tuple[int, ...]:
  """The rows of a batch of `rows` that this host's devices hold, in
  order."""
  held = set()
  for index in sharding.addressable_devices_indices_map((rows,)).values():
    held.update(range(rows)[index[0]])
  return tuple(sorted(held))
