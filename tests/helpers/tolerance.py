"""What "equal" means in the tests, one kind of comparison at a time. Trees
and arrays are compared through chex with these tolerances, e.g.
`chex.assert_trees_all_close(got, want, **tolerance.FLOAT32)`: the same
tree structure, then each leaf within atol + rtol * |want|."""

import chex
import numpy as np

# Two float32 computations of one function that sum in other orders: an
# attention variant against the dense core on the pattern's explicit mask.
FLOAT32 = {'atol': 1e-5, 'rtol': 1e-5}
# A fused kernel (Pallas interpreted on the CPU, cuDNN's call) against the
# dense core: its blocks accumulate the softmax online, in float32.
KERNEL = {'atol': 2e-5, 'rtol': 1e-4}
# The same with bfloat16 inputs, against float64 on those inputs: half a
# bfloat16 ulp of each value (its rounding, 2^-8 relative), and 2e-2 for
# the gradients' sums of rounded terms (a T5 table's needs 1.4e-2).
BFLOAT16 = {'atol': 2e-2, 'rtol': 2 ** -8}


def _same_bits(x, y) -> bool:
  x, y = np.asarray(x), np.asarray(y)
  return (x.dtype == y.dtype and x.shape == y.shape
          and x.tobytes() == y.tobytes())


def _differing_bits(x, y) -> str:
  x, y = np.asarray(x), np.asarray(y)
  if (x.dtype, x.shape) != (y.dtype, y.shape):
    return f'{x.dtype}{list(x.shape)} against {y.dtype}{list(y.shape)}'
  return f'{np.sum(x != y)} of {x.size} elements differ'


def assert_bitwise_equal(got, want) -> None:
  """Exact: the same tree, and each leaf of the same dtype, shape and bits
  (a resumed run against one never interrupted)."""
  chex.assert_trees_all_equal_comparator(_same_bits, _differing_bits, got,
                                         want)
