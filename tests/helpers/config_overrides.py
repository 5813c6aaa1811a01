"""Setting config keys by their dotted names, as `--config.a.b=value` does."""


def apply(config, values: dict):
  """`config` with each dotted key of `values` set; returns `config`."""
  for key, value in values.items():
    *parents, leaf = key.split('.')
    node = config
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return config
