"""The registered attention names, one a function: what the tests of the
functions themselves run (mla's function is chunked's, its own work being
the projections around it, tested in
tests/model/attention/variants/test_latent.py)."""

from model import attention


def distinct_variants() -> list[str]:
  """The sorted names, each the first of those sharing its function."""
  seen, names = set(), []
  for name in attention.names():
    if attention.get(name) not in seen:
      seen.add(attention.get(name))
      names.append(name)
  return names
