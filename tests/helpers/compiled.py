"""Calls compiled whole: what the tests call eagerly runs op by op, a
compilation per operation (seconds for a variant of many small ones, as
bigbird's gathers); one program per call compiles in a fraction of it."""

import functools

import jax
import numpy as np


def _traced(value) -> bool:
  """Whether a keyword argument holds arrays (traced) or is a setting."""
  return any(isinstance(leaf, (jax.Array, np.ndarray))
             for leaf in jax.tree.leaves(value))


@functools.cache
def _program(fn, static: tuple):
  return jax.jit(functools.partial(fn, **dict(static)))


def compiled(fn):
  """fn, each call one compiled program: the positional arguments and the
  keyword arguments that hold arrays traced, the other keywords static
  (one program per fn and settings)."""
  @functools.wraps(fn)
  def call(*args, **kwargs):
    static = tuple(sorted((key, value) for key, value in kwargs.items()
                          if not _traced(value)))
    traced = {key: value for key, value in kwargs.items() if _traced(value)}
    try:
      program = _program(fn, static)
    except TypeError:  # A setting that is not hashable: compiled anew.
      program = _program.__wrapped__(fn, static)
    return program(*args, **traced)
  return call
