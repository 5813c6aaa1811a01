"""Tiny Hugging Face models (transformers' Flax GPT-2 and Llama, random
weights), the references of the import and export tests."""

import jax
import jax.numpy as jnp
import numpy as np
import transformers

# The byte dataset's ids (padding, end of sequence, 256 bytes) are the
# tiny models' vocabulary.
VOCAB = 258
TOKENS_BxT = jnp.asarray(np.random.RandomState(0).randint(2, VOCAB, (2, 24)))
# transformers' Flax class of each architecture.
CLASSES = {'gpt2': transformers.FlaxGPT2LMHeadModel,
           'llama': transformers.FlaxLlamaForCausalLM}


def reference(name: str, **llama):
  """A tiny Hugging Face model of architecture `name` (`llama`: more
  LlamaConfig keys), every parameter random (biases and norm gains
  too)."""
  if name == 'gpt2':
    model = CLASSES['gpt2'](transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64),
                            seed=0)
  else:
    # rope_theta stays at 10000: the Flax Llama ignores any other.
    model = CLASSES['llama'](transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
        max_position_embeddings=64, rms_norm_eps=1e-5, **llama), seed=0)
  leaves, tree = jax.tree.flatten(model.params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  model.params = jax.tree.unflatten(tree, [
      leaf + 0.1 * jax.random.normal(key, leaf.shape)
      for leaf, key in zip(leaves, keys)])
  return model


def saved(name: str, tmp_path) -> tuple:
  """(the reference, the directory it is saved in)."""
  model = reference(name)
  directory = str(tmp_path / f'hf_{name}')
  model.save_pretrained(directory, safe_serialization=True)
  return model, directory
