"""The error for bad input a person can fix."""


class InputError(ValueError):
  """A wrong config value or a missing dataset; the message says which key
  or what to do. Entry points print it and exit with status 2."""
