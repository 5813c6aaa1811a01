"""The parameters an attention variant owns (Variant.parameters), created
outside a model as its attention layer would create them."""

import flax.linen as nn
import jax

from model import ModelConfig, attention


class _Owner(nn.Module):
  name_of: str
  config: ModelConfig

  @nn.compact
  def __call__(self):
    parameters = attention.spec(self.name_of).parameters
    return parameters(self, self.config, **dict(
        self.config.attention_options)) if parameters else {}


def owned(name: str, *, d_model: int, num_heads: int, num_kv_heads: int,
          seed: int = 0, **options) -> tuple[dict, dict]:
  """(the variant's keyword arguments, its parameters as declared, boxed)
  for a layer of `d_model` with these heads and attention `options`,
  initialised from `seed`."""
  config = ModelConfig(d_model=d_model, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, attention=name,
                       attention_options=options)
  kwargs, variables = _Owner(name, config).init_with_output(
      jax.random.key(seed))
  return nn.meta.unbox(kwargs), variables.get('params', {})
