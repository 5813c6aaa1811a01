"""Attention transfer's per-layer errors against Flax's own record of each
model's attention outputs, and zero for a student that is its teacher."""

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from configs import default
from train.run import attention_transfer
from train.run.program import Program


def _program(attention: str) -> Program:
  config = default.get_config()
  config.update(batch_size=2, seq_len=8, pack_sequences=False)
  config.model.update(vocab_size=16, d_model=8, num_heads=2, num_layers=2,
                      mlp_dim=16, max_len=8, attention=attention,
                      position='none')
  return Program.from_config(config, jax.devices()[:1])


def _attention_outputs(program: Program, params, batch) -> list:
  """Each self-attention layer's output in the model's own forward pass,
  as Flax's capture_intermediates records it."""
  _, state = program.model.apply(
      {'params': params}, *program.task.model_args(batch),
      capture_intermediates=lambda module, method: (
          method == '__call__' and module.name == 'self_attention'))
  blocks = state['intermediates']['decoder']
  return [blocks[f'block_{layer}']['self_attention']['__call__'][0][0]
          for layer in range(2)]


def test_layer_errors_are_the_attention_outputs_mean_squared_errors():
  teacher, student = _program('dense'), _program('hedgehog')
  batch = teacher.task.synthetic_batch(teacher.config)
  teacher_params = teacher.init().params
  # The teacher's parameters, and feature maps moved off the identity.
  have = traverse_util.flatten_dict(teacher_params)
  student_params = traverse_util.unflatten_dict({
      path: have.get(path, leaf + 0.3) for path, leaf in
      traverse_util.flatten_dict(student.init().params).items()})
  errors = attention_transfer.layer_errors(teacher, student, teacher_params,
                                           student_params, batch)
  # The first layer reads the same embeddings in both models' own passes.
  want = _attention_outputs(teacher, teacher_params, batch)[0]
  got = _attention_outputs(student, student_params, batch)[0]
  np.testing.assert_allclose(errors[0], jnp.mean(jnp.square(got - want)),
                             rtol=1e-5)
  assert errors[1] > 0
  np.testing.assert_array_equal(
      attention_transfer.layer_errors(teacher, teacher, teacher_params,
                                      teacher_params, batch), [0.0, 0.0])
