"""How the hosts of a multi-host run agree."""

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
