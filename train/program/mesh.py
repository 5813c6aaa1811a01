"""The device mesh of a run, from `config.parallelism`, and multi-host start.

The mesh has four named axes, always in this order (MESH_AXES, declared
with the keys that size them in train/base/train_config.py):
  data      data parallelism: each replica takes a slice of the batch.
  fsdp      fully sharded data parallelism (ZeRO-3): a slice of the batch
            too, and every parameter split along its `embed` dim; XLA
            gathers a weight where it is used and scatters its gradient.
  tensor    tensor parallelism (Megatron-LM): attention heads, MLP hidden
            units and the vocabulary split, activations gathered after.
  sequence  sequence parallelism: activations split along the length; the
            `ring` attention variant passes keys and values round this axis.
An axis of size 1 costs nothing. Which parameter and activation dims go to
which axis is `config.logical_axis_rules` (see train/program/sharding.py).
"""

from collections.abc import Sequence
import math
import os

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh
import ml_collections
import numpy as np

from train.base.errors import InputError
from train.base.train_config import MESH_AXES, Parallelism

STRATEGIES = ('pjit', 'pmap')


def axis_sizes(parallelism: Parallelism, num_devices: int) -> dict[str, int]:
  """{axis: size} with any -1 resolved; InputError naming the key when the
  sizes are not positive integers or do not multiply to `num_devices`."""
  sizes = {}
  for axis in MESH_AXES:
    size = getattr(parallelism, axis)
    if isinstance(size, bool) or not isinstance(size, int) or (
        size < 1 and size != -1):
      raise InputError(f'config.parallelism.{axis}={size!r} must be a '
                       'positive integer, or -1 for the devices left over.')
    sizes[axis] = size
  free = [axis for axis, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise InputError(
        f'config.parallelism: only one axis may be -1, got {", ".join(free)}.')
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if num_devices % fixed:
      raise InputError(
          f'config.parallelism.{free[0]}=-1: the other axes take {fixed} '
          f'devices, which does not divide the {num_devices} devices.')
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    layout = ' x '.join(f'{axis}={size}' for axis, size in sizes.items())
    raise InputError(
        f'config.parallelism: {layout} takes {fixed} devices, but there are '
        f'{num_devices}; set one axis to -1 to take the rest.')
  return sizes


def make_mesh(parallelism: Parallelism,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The mesh over `devices` (default: every device of every host).

  With `parallelism.dcn_data` > 1 (multi-slice TPU), the data axis spans
  that many slices over the data-centre network, and every other axis stays
  within a slice, on the fast inter-chip links.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = axis_sizes(parallelism, len(devices))
  shape = [sizes[axis] for axis in MESH_AXES]
  slices = parallelism.dcn_data
  if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
    raise InputError(f'config.parallelism.dcn_data={slices!r} must be a '
                     'positive integer.')
  if slices == 1:
    grid = mesh_utils.create_device_mesh(shape, devices,
                                         allow_split_physical_axes=True)
  else:
    found = len({getattr(device, 'slice_index', 0) for device in devices})
    if sizes['data'] % slices or found != slices:
      raise InputError(
          f'config.parallelism.dcn_data={slices} must divide '
          f'config.parallelism.data={sizes["data"]} and equal the number of '
          f'TPU slices ({found} here).')
    within = [shape[0] // slices] + shape[1:]
    grid = mesh_utils.create_hybrid_device_mesh(
        within, [slices, 1, 1, 1], devices, allow_split_physical_axes=True)
  # Auto axes, chosen on purpose (jax.make_mesh would give Explicit ones):
  # parameters and activations are placed by NamedShardings derived from
  # logical names and by sharding constraints, and the compiler propagates
  # the rest. Explicit axes would make every intermediate's sharding part of
  # its type and reject ops whose output sharding is ambiguous.
  return Mesh(np.asarray(grid).reshape(shape), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))


def start_distributed(config: ml_collections.ConfigDict, *,
                      coordinator_address: str | None = None,
                      num_processes: int | None = None,
                      process_id: int | None = None) -> None:
  """Joins this process to a multi-host run, before any JAX computation.

  With `coordinator_address`, `num_processes` and `process_id` given, they
  say how to join; with `config.distributed` (or JAX_COORDINATOR_ADDRESS
  set), JAX reads what is not given from the cluster (Cloud TPU, Slurm,
  Open MPI, Kubernetes). Otherwise this is a single-host run.
  """
  if coordinator_address is None and not config.distributed and (
      'JAX_COORDINATOR_ADDRESS' not in os.environ):
    return
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes,
                             process_id=process_id)
