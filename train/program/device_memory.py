"""What a device holds, and what a train step needs of it: compiled (the
figures of its memory analysis), or bounded below from the config alone,
before anything is traced or compiled."""

import os

import jax

from model.families import FAMILIES
from train.base.train_config import TrainConfig
from train.data.tasks import Task
from train.program.cross_entropy import MAX_BLOCK_LOGITS


def held_bytes(host_share: float) -> int:
  """What one local device can hold: its allocator's limit or, where it
  reports none (a CPU), `host_share` of the machine's memory."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if 'bytes_limit' in stats:
    return int(stats['bytes_limit'])
  host = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  return int(host_share * host)


def needed_bytes(memory) -> int:
  """A compiled program's bytes on a device, from its `memory_analysis()`:
  arguments, outputs and temporaries, less what it updates in place."""
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)


def least_step_bytes(config: TrainConfig, task: Task, positions: int,
                     devices: int, params: int = 0) -> dict[str, int]:
  """What a train step of `config` holds at least on the fullest of
  `devices`, by kind, from shapes alone: its `params` parameters and,
  where the forward pass ends, each block's input over `positions`
  positions (kept for the backward pass under any remat policy) beside
  the largest tensor one layer makes (a dense feed-forward layer's hidden
  activations, a dense layer's float32 attention weights [B, N, T, S], a
  block of float32 vocabulary logits), or, where more, the parameters'
  gradients. Each is spread over every device, which no layout betters."""
  model = config.model
  family = FAMILIES[model.family]
  micro_batch = config.batch_size // config.grad_accum_steps
  tokens = micro_batch * positions
  width = model.compute_dtype.itemsize
  # A family without Transformer blocks keeps its states [B, T, D] at least.
  blocks = model.num_layers if family.feed_forward else 1
  layers = range(model.num_layers if family.feed_forward else 0)
  largest = {'vocabulary logits': (min(tokens * model.vocab_size,
                                       MAX_BLOCK_LOGITS) * 4
                                   if task.vocabulary_logits else 0)}
  if any(not model.has_moe(layer) for layer in layers):
    largest['feed-forward activations'] = tokens * model.mlp_dim * width
  # Dense attention is the one that holds a layer's weights whole.
  if any(model.for_layer(layer).attention == 'dense' for layer in layers):
    largest['attention weights'] = (
        micro_batch * model.num_heads * positions
        * (positions + model.memory_length) * 4)
  kind = max(largest, key=largest.get)
  forward = {'block inputs': blocks * tokens * model.d_model * width,
             kind: largest[kind]}
  gradients = {'gradients': params * model.weight_dtype.itemsize}
  parts = {'parameters': params * model.weight_dtype.itemsize} | max(
      forward, gradients, key=lambda part: sum(part.values()))
  return {name: -(-size // devices) for name, size in parts.items() if size}
