"""A run's program: several optimizer steps in one call
(config.steps_per_call) are the same steps as one call each."""

import jax
import numpy as np
import pytest

from configs import lm_stdlib
from tests.helpers import config_overrides
from train.data import pipeline
from train.run.program import Program

K = 4
TINY = {'seq_len': 32, 'batch_size': 8, 'model.d_model': 16,
        'model.num_heads': 2, 'model.num_layers': 1, 'model.mlp_dim': 32,
        'model.max_len': 33, 'model.dropout_rate': 0.1, 'steps_per_call': K,
        'log_every': K, 'eval_every': K, 'checkpoint_every': K,
        # One layer: no first layer's values to mix into a later one's.
        'model.value_residual': False}
CASES = {
    # Dropout, experts, two micro-batches, and a poisoned batch inside the
    # call whose update is skipped.
    'lm_moe_accumulated_skipping': {
        'model.moe.num_experts': 2, 'model.moe.top_k': 1,
        'model.moe.every_n_layers': 1, 'grad_accum_steps': 2,
        'nan_policy': 'skip'},
    # A Transformer-XL memory carried from step to step.
    # On the second search's winner: the default's windows and smear read
    # no memory.
    'lm_memory': {'model.memory_length': 8, 'pack_sequences': False},
}


def bytes_of(tree) -> list[bytes]:
  return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize('name', CASES)
def test_steps_in_one_call_equal_one_call_each_bitwise(name):
  config = config_overrides.apply(
      lm_stdlib.get_config('round2' if name == 'lm_memory' else ''),
      TINY | CASES[name])
  program = Program.from_config(config, jax.devices()[:2])
  host = [program.task.synthetic_batch(program.config, seed=seed)
          for seed in range(K)]
  if program.config.nan_policy == 'skip':
    host[2] = pipeline.poisoned(host[2])
  batches = [program.batch(batch) for batch in host]
  rng = program.key(1)
  with program.scope():
    state, each = program.init(), []
    for batch in batches:
      state, metrics = program.train_step(state, batch, rng)
      each.append(jax.device_get(metrics))
    called, stacked = program.train_steps(program.init(),
                                          program.place(host), rng)
  assert bytes_of(jax.device_get(called)) == bytes_of(jax.device_get(state))
  stacked = jax.device_get(stacked)
  for index, metrics in enumerate(each):
    assert bytes_of({key: stacked[key][index] for key in metrics}) == (
        bytes_of(metrics)), index
  if program.config.nan_policy == 'skip':
    assert [float(m['skipped']) for m in each] == [0, 0, 1, 0]
  assert int(called.step) == K
