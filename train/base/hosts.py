"""How the hosts of a multi-host run agree."""

import json
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np


def minimum_over_hosts(value: float) -> float:
  """The smallest `value` of all hosts (this host's on one host): how the
  hosts of a run agree on a check that each makes on its own, so that
  none stops while the others wait for it. Exchanged in float32 (JAX's
  widest type by default), exact for integers up to 2**24 and to about
  1e-7 relative beyond: enough to compare free disk space with a size."""
  if jax.process_count() == 1:
    return value
  return float(np.min(multihost_utils.process_allgather(np.float32(value))))


def gathered(value: Any) -> list[Any]:
  """Every host's `value` (anything JSON holds), in host order."""
  if jax.process_count() == 1:
    return [value]
  encoded = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.int32(len(encoded)))
  # Padded to a power of two: few distinct shapes to exchange.
  padded = np.zeros(1 << int(np.max(sizes)).bit_length(), np.uint8)
  padded[:len(encoded)] = encoded
  every = multihost_utils.process_allgather(padded)
  return [json.loads(bytes(row[:size])) for row, size in zip(every, sizes)]
