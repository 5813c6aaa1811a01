"""A Transformer stack's blocks in its two layouts, and the conversion of any
tree that holds them (parameters, optimizer states, their shapes, sown
collections) from one to the other.

Unscanned (config.model.scan_layers=False): a stack's mapping holds one
subtree per block, `block_0` ... `block_{L-1}`.

Scanned: the stack's first `config.scan_start` blocks keep theirs; the
others run as n groups of G = `config.scan_group` blocks under `layers`,
which holds `block_0` ... `block_{G-1}`, each a subtree whose arrays stack
the n groups' along a leading axis: `layers/block_j[g]` is block
scan_start + g * G + j.

Both directions read the layout from the trees themselves, so a checkpoint
converts without its config: `relayout(tree, like)` gives `tree` in the
layout of `like`, a tree of the same model (or its shapes, or orbax's
metadata of a checkpoint of it).
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from model.attention.core.logical_axes import LAYERS

_PREFIX = 'block_'


def block_number(name: str) -> int | None:
  """N of a block's name 'block_N' (its key in a stack, and in a module's
  path); None for any other name."""
  number = name[len(_PREFIX):]
  return int(number) if name.startswith(_PREFIX) and number.isdigit() else None


def _blocks(node: Mapping) -> list[str]:
  """The block keys of a stack's mapping, in order."""
  numbers = [block_number(key) for key in node]
  return [f'{_PREFIX}{number}' for number in sorted(
      number for number in numbers if number is not None)]


def _is_stack(node: Any) -> bool:
  return isinstance(node, Mapping) and (LAYERS in node
                                        or f'{_PREFIX}0' in node)


def _map_stacks(fn: Callable[[Mapping], dict], tree: Any) -> Any:
  """`tree` with `fn` applied to each stack's mapping (one holding
  `block_0` or `layers`); everything else kept."""
  def visit(node):
    if not isinstance(node, Mapping):
      return node
    if _is_stack(node):
      return fn(node)
    return {key: _map_stacks(fn, value) for key, value in node.items()}
  return jax.tree.map(visit, tree,
                      is_leaf=lambda node: isinstance(node, Mapping))


def _respec(sharding: Any, spec: Callable[[tuple], tuple]) -> Any:
  """A named sharding with its partition spec's entries `spec(entries)`;
  any other sharding (one device's) as it is."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  return jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(*spec(tuple(sharding.spec))))


def _stack(leaves: tuple) -> Any:
  """Arrays (or their shapes) stacked along a new leading axis."""
  first = leaves[0]
  if isinstance(first, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(
        (len(leaves),) + first.shape, first.dtype,
        sharding=_respec(first.sharding, lambda spec: (None,) + spec))
  if isinstance(first, np.ndarray):
    return np.stack(leaves)
  return jnp.stack(leaves)


def _take(leaf: Any, index: int) -> Any:
  """Entry `index` of an array (or its shape) along its leading axis."""
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(
        leaf.shape[1:], leaf.dtype,
        sharding=_respec(leaf.sharding, lambda spec: spec[1:]))
  return leaf[index]


def layout(tree: Any) -> tuple[int, int] | None:
  """(G, the blocks before the groups) of the first scanned stack in
  `tree`; None where it holds only unscanned ones (or none)."""
  found = []

  def record(node):
    if LAYERS in node and not found:
      found.append((len(_blocks(node[LAYERS])), len(_blocks(node))))
    return node
  _map_stacks(record, tree)
  return found[0] if found else None


def stacked(tree: Any, group: int, start: int) -> Any:
  """`tree`'s unscanned stacks in the scanned layout of groups of `group`
  blocks after the first `start`."""
  def stack(node):
    if LAYERS in node:
      return dict(node)
    blocks = _blocks(node)
    count = (len(blocks) - start) // group
    if count < 1 or count * group != len(blocks) - start:
      raise ValueError(f'{len(blocks)} blocks are not {start} and groups of '
                       f'{group}.')
    out = {key: value for key, value in node.items()
           if key not in blocks[start:]}
    out[LAYERS] = {
        f'{_PREFIX}{j}': jax.tree.map(
            lambda *leaves: _stack(leaves),
            *[node[blocks[start + g * group + j]] for g in range(count)])
        for j in range(group)}
    return out
  return _map_stacks(stack, tree)


def unstacked(tree: Any, group: int | None = None,
              start: int | None = None) -> Any:
  """`tree`'s scanned stacks in the unscanned layout. A tree holding every
  block's subtree (parameters and their statistics) shows its groups;
  one holding some blocks' only (a collection some blocks sow into) needs
  `group` and `start` (config.scan_group and scan_start)."""
  def unstack(node):
    if LAYERS not in node:
      return dict(node)
    groups = node[LAYERS]
    size = len(_blocks(groups)) if group is None else group
    first = len(_blocks(node)) if start is None else start
    count = jax.tree.leaves(groups)[0].shape[0]
    out = {key: value for key, value in node.items() if key != LAYERS}
    for g in range(count):
      for key, subtree in groups.items():
        out[f'{_PREFIX}{first + g * size + block_number(key)}'] = jax.tree.map(
            lambda leaf: _take(leaf, g), subtree)
    return out
  return _map_stacks(unstack, tree)


def relayout(tree: Any, like: Any) -> Any:
  """`tree` in the layout of `like` (scanned or not, and its groups)."""
  have, want = layout(tree), layout(like)
  if have == want:
    return tree
  if have is not None:
    tree = unstacked(tree)
  return tree if want is None else stacked(tree, *want)
