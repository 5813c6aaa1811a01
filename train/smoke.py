"""Smoke run: one jitted forward and backward pass of the default model.

Checks that the install works end to end on this machine: the default
config validates, the model initialises, and the loss and its gradients are
finite. The training loop itself is not part of the codebase yet; this is
what `make train` runs until it is.
"""

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from configs import default
from model import ModelConfig, build

BATCH, LENGTH = 8, 128


def main() -> None:
  config = default.get_config()
  model_config = ModelConfig.from_mapping(config.model)
  model = build(model_config)
  init_rng, data_rng = jax.random.split(jax.random.key(config.seed))
  tokens = jax.random.randint(data_rng, (BATCH, LENGTH + 1), 1,
                              model_config.vocab_size)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  params = nn.meta.unbox(jax.jit(model.init)(init_rng, inputs)['params'])

  @jax.jit
  def loss_and_grads(params):
    def loss_fn(params):
      logits = model.apply({'params': params}, inputs)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, targets).mean()
    return jax.value_and_grad(loss_fn)(params)

  start = time.perf_counter()
  loss, grads = jax.block_until_ready(loss_and_grads(params))
  seconds = time.perf_counter() - start
  num_params = sum(x.size for x in jax.tree.leaves(params))
  grad_norm = optax.tree.norm(grads)
  print(f'model: {model_config.family}, {num_params:,} parameters, '
        f'{jax.device_count()} {jax.default_backend()} device(s)')
  print(f'forward+backward on [{BATCH}, {LENGTH}] random tokens: '
        f'loss {float(loss):.3f} (uniform: '
        f'{float(jnp.log(model_config.vocab_size)):.3f}), '
        f'gradient norm {float(grad_norm):.3f}, '
        f'{seconds:.1f} s including compilation')
  if not (jnp.isfinite(loss) and jnp.isfinite(grad_norm)):
    raise SystemExit('smoke run failed: non-finite loss or gradients')
  print('smoke run passed; the training loop is not built yet, so this is '
        'all `make train` does for now.')


if __name__ == '__main__':
  main()
