"""What a device holds, and what a compiled program needs of it."""

import os

import jax


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
