"""config.init_from: a run that starts from another run's parameters.

`transfer` maps a source model's parameters onto a target model's shapes:
a parameter of the same path and shape is taken as it is; the key and
value projections of a source with more key/value heads are mean-pooled
over each group of heads (the uptraining of multi-head checkpoints to
grouped-query attention, Ainslie et al. 2023); a parameter the source
lacks (one an attention variant or position scheme adds) starts fresh,
and one the target lacks is left out. Any other change of shape is
refused, naming the parameters and the config.model keys that differ:
`check_fits` compares the shapes before the run claims its workdir.

`load` reads the source's parameters alone (never its optimizer state),
sharded on the target's mesh as they arrive, and transfers them there in
one compiled function, which initialises only the new ones: a model larger
than one device starts from another.
"""

import dataclasses
import math
from typing import Any

import flax
from flax import traverse_util
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model import ModelConfig, layer_stack
from train.base import storage
from train.base.errors import InputError, TrainingError
from train.run import trained_run
from train.run.program import Program

# The key/value projections, which pooling may shrink to fewer heads.
_POOLED = ('key', 'value')


@dataclasses.dataclass(frozen=True)
class Transferred:
  """The target's parameters, and how each was obtained (paths as
  'decoder/block_0/mlp/wi/kernel')."""

  params: Any
  taken: tuple[str, ...]
  pooled: tuple[str, ...]
  fresh: tuple[str, ...]
  left_out: tuple[str, ...]

  def summary(self) -> str:
    """One line: how many parameters came from where."""
    parts = [f'{len(self.taken)} parameters taken as they are']
    if self.pooled:
      parts.append(f'{len(self.pooled)} key/value projection parameters '
                   'mean-pooled to fewer heads')
    for name, paths in (('new, initialised fresh', self.fresh),
                        ('left out', self.left_out)):
      if paths:
        shown = ', '.join(paths[:3]) + (', ...' if len(paths) > 3 else '')
        parts.append(f'{len(paths)} {name} ({shown})')
    return '; '.join(parts)


def _flat(tree: Any) -> dict[str, Any]:
  """{'decoder/block_0/mlp/wi/kernel': leaf, ...} of a parameter tree."""
  return traverse_util.flatten_dict(flax.core.unfreeze(tree), sep='/')


def _poolable(path: str, have: tuple[int, ...], want: tuple[int, ...]
              ) -> bool:
  """Whether a key/value projection of shape `have` pools to `want`'s fewer
  heads (the heads axis: a kernel's [D, K, H] second, a bias's [K, H]
  first), the only axis that differs."""
  parts = path.split('/')
  if len(parts) < 2 or parts[-2] not in _POOLED or len(have) != len(want):
    return False
  axis = len(have) - 2
  same_elsewhere = all(a == b for i, (a, b) in enumerate(zip(have, want))
                       if i != axis)
  return (same_elsewhere and want[axis] < have[axis]
          and not have[axis] % want[axis])


def _pooled(array: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """A key/value projection pooled to `shape`'s fewer heads (_poolable)."""
  axis = array.ndim - 2
  heads, target = array.shape[axis], shape[axis]
  # Key/value head j serves query heads j*N/K .. (j+1)*N/K - 1: the source
  # heads of a group are consecutive.
  grouped = array.reshape(*array.shape[:axis], target, heads // target,
                          *array.shape[axis + 1:])
  return grouped.mean(axis=axis + 1)


def config_differences(source: ModelConfig, target: ModelConfig) -> str:
  """'mlp_dim (512 -> 256), ...': the config.model keys that differ."""
  changed = [
      f'{field.name} ({getattr(source, field.name)!r} -> '
      f'{getattr(target, field.name)!r})'
      for field in dataclasses.fields(ModelConfig)
      if getattr(source, field.name) != getattr(target, field.name)]
  return ', '.join(changed) or 'no key'


def _ways(have: dict[str, Any], want: dict[str, Any], source: ModelConfig,
          target: ModelConfig, origin: str) -> dict[str, str]:
  """How each of the target's parameters (`want`, flat, arrays or their
  shapes) comes from the source's (`have`): 'taken', 'pooled' or 'fresh';
  InputError naming those that do not fit and the config.model keys that
  differ."""
  ways, misfits = {}, []
  for path, leaf in want.items():
    if path not in have:
      ways[path] = 'fresh'
    elif have[path].shape == leaf.shape:
      ways[path] = 'taken'
    elif _poolable(path, have[path].shape, leaf.shape):
      ways[path] = 'pooled'
    else:
      misfits.append(f'{path} {list(have[path].shape)} there, '
                     f'{list(leaf.shape)} here')
  differing = config_differences(source, target)
  if misfits:
    shown = '; '.join(misfits[:3]) + ('; ...' if len(misfits) > 3 else '')
    raise InputError(
        f'config.init_from={origin}: parameters of it do not fit this model '
        f'({shown}; {len(misfits)} in all); config.model differs in '
        f'{differing}.')
  if set(ways.values()) <= {'fresh'}:
    raise InputError(
        f'config.init_from={origin}: no parameter of it has a place in this '
        f'model; config.model differs in {differing}.')
  return ways


def transfer(source_params: Any, fresh_params: Any, source: ModelConfig,
             target: ModelConfig, origin: str) -> Transferred:
  """The target's parameters (`fresh_params`' tree and dtypes) from
  `source_params`; InputError naming the parameters that do not fit and
  the config.model keys that differ. `origin` names the source in
  messages. Either model may scan its layers (config.model.scan_layers):
  blocks are matched one by one (paths as 'decoder/block_3/...', so that a
  change of depth keeps the blocks both have), then stacked as the target
  stacks them."""
  have = _flat(layer_stack.unstacked(source_params))
  ways = _ways(have, _flat(layer_stack.unstacked(fresh_params)), source,
               target, origin)
  return _described(_transferred(source_params, fresh_params, ways,
                                 fresh_params), ways, have)


def _described(params: Any, ways: dict[str, str], have: dict[str, Any]
               ) -> Transferred:
  """`params` with how each was obtained (`ways`, by path) and the source's
  (`have`, flat) that the target lacks."""
  by_way = lambda name: tuple(p for p, way in ways.items() if way == name)
  return Transferred(params, by_way('taken'), by_way('pooled'),
                     by_way('fresh'), tuple(sorted(set(have) - set(ways))))


def _transferred(source_params: Any, fresh_params: Any, ways: dict[str, str],
                 like: Any) -> Any:
  """The target's parameters, in the layout, shapes and dtypes of `like`
  (arrays or their shapes), each obtained from the source's or
  `fresh_params` (None where none is 'fresh') as `ways` says; traceable."""
  have = _flat(layer_stack.unstacked(source_params))
  want = _flat(layer_stack.unstacked(like))
  fresh = (None if fresh_params is None
           else _flat(layer_stack.unstacked(fresh_params)))
  values = {}
  for path, way in ways.items():
    leaf = want[path]
    if way == 'fresh':
      values[path] = fresh[path]
    elif way == 'taken':
      values[path] = jnp.asarray(have[path]).astype(leaf.dtype)
    else:
      values[path] = _pooled(jnp.asarray(have[path]),
                             leaf.shape).astype(leaf.dtype)
  return layer_stack.relayout(traverse_util.unflatten_dict(values, sep='/'),
                              like)


def run_source(path: str) -> tuple[str, int | None]:
  """(a training run's workdir, a checkpoint step or None for its latest)
  that `path` names: WORKDIR or WORKDIR/checkpoints/STEP."""
  path = storage.resolve(path)
  parent, _, name = path.rpartition('/')
  if name.isdigit() and parent.rpartition('/')[2] == 'checkpoints':
    return parent.rpartition('/')[0], int(name)
  return path, None


def _resumes(workdir: str) -> bool:
  """Whether `workdir` holds a checkpoint, which its run resumes from."""
  return bool(trained_run.checkpoint_steps(workdir))


def source_problem(path: str, named: str) -> str | None:
  """What is wrong with `path` as a run to start from, `named` the flag or
  key that gave it (and its value), before anything is built: it must be
  a training run's workdir or one of its checkpoints."""
  run, step = run_source(path)
  if not (storage.path(run) / 'config.json').is_file():
    return (f'{named} is not a training run\'s workdir (it has no '
            'config.json) nor one of its checkpoints '
            '(WORKDIR/checkpoints/STEP).')
  missing = step is not None and trained_run.no_checkpoint(run, step)
  return f'{named}: {missing}.' if missing else None


def check(init_from: str, workdir: str) -> str | None:
  """What is wrong with config.init_from for a run in `workdir`, before
  anything is built: nothing once the workdir holds a checkpoint (the run
  resumes from its own), else the source must be there."""
  if _resumes(workdir):
    return None
  return source_problem(init_from, f'config.init_from={init_from!r}')


def _source(init_from: str) -> tuple[str, int | None, Program]:
  """(the source run's workdir, its checkpoint step or None, its program
  on one of this process's devices); InputError naming config.init_from
  where its config cannot be read."""
  run, step = run_source(init_from)
  try:
    config = trained_run.load_config(run)
    return run, step, Program.from_config(config, jax.local_devices()[:1])
  except (InputError, TrainingError) as error:
    raise InputError(f'config.init_from={init_from}: {error}') from None


def check_fits(program: Program, workdir: str) -> None:
  """InputError, as `load` would raise it, unless the parameters of
  `program`'s config.init_from fit its model: compared by shape before the
  run claims `workdir`, so that a refused start leaves nothing there.
  Nothing to check without init_from, or once the workdir resumes."""
  init_from = program.config.init_from
  if init_from is None or _resumes(workdir):
    return
  _, _, source = _source(init_from)
  _ways(_flat(layer_stack.unstacked(source.abstract_state.params)),
        _flat(layer_stack.unstacked(program.abstract_state.params)),
        source.model_config, program.model_config, init_from)


def _on_mesh(leaf: jax.ShapeDtypeStruct, mesh: Mesh) -> jax.ShapeDtypeStruct:
  """`leaf` (laid out on another mesh with the same axis names) sharded
  alike on `mesh`, replicated where its sizes do not divide there."""
  spec = leaf.sharding.spec
  divides = all(
      size % math.prod(mesh.shape[axis] for axis in
                       ((axes,) if isinstance(axes, str) else axes or ()))
      == 0 for size, axes in zip(leaf.shape, spec))
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(
      mesh, spec if divides else P()))


def load(init_from: str, program: Program) -> tuple[Transferred, str]:
  """(`program`'s parameters from the source's checkpoint and how each was
  obtained, a line saying where they came from): the source's parameters
  alone (not its optimizer state) are read straight onto `program`'s
  mesh, sharded as there, and mapped onto its parameters there
  (`transfer`) in one compiled function, which initialises only the new
  ones; none is gathered onto one device. InputError, naming
  config.init_from, when the source has no checkpoint that verifies or its
  parameters do not fit."""
  run, step, source = _source(init_from)
  abstract = program.abstract_state.params
  have = _flat(layer_stack.unstacked(source.abstract_state.params))
  ways = _ways(have, _flat(layer_stack.unstacked(abstract)),
               source.model_config, program.model_config, init_from)
  try:
    step, source_params = trained_run.restore_params(
        run, jax.tree.map(lambda leaf: _on_mesh(leaf, program.mesh),
                          source.abstract_state.params), step)
  except (InputError, TrainingError) as error:
    raise InputError(f'config.init_from={init_from}: {error}') from None
  # Fresh parameters initialised in the same program, which keeps only
  # those that are new.
  fresh = 'fresh' in ways.values()
  params = jax.jit(
      lambda source_params: _transferred(
          source_params, program.init_params() if fresh else None, ways,
          abstract),
      out_shardings=jax.tree.map(lambda leaf: leaf.sharding, abstract))(
          source_params)
  transferred = _described(params, ways, have)
  said = f'the parameters of {init_from} at step {step}'
  if source.config.dataset != program.config.dataset:
    said += f' (trained on config.dataset={source.config.dataset!r})'
  return transferred, f'{said}: {transferred.summary()}'
