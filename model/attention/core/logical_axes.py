"""Logical axis names that more than one layer of the code must agree on.

The model lays out its activations and attention heads by these names;
train/program/sharding.py's rules map them to mesh axes; the fused attention
kernels (model/attention/kernels/fused_kernels.py) read the same rules to split
their `shard_map` as the model's own arrays are split. A renamed axis
changes all three at once.
"""

# Activations [B, T, D] between blocks: by example, position and feature.
BATCH = 'activation_batch'
LENGTH = 'activation_length'
EMBED = 'activation_embed'
ACTIVATIONS = (BATCH, LENGTH, EMBED)
# The query heads and the key/value heads of attention's projections.
HEADS = 'heads'
KV_HEADS = 'kv_heads'
# The width of latent attention's shared latent
# (model/attention/variants/latent.py); no default rule splits it, as every
# head's keys and values read all of it.
LATENT = 'latent'
# The leading axis of a scanned stack's parameters, one entry per group of
# blocks (config.model.scan_layers): left whole on every device by the
# rules, as each step of the loop reads one entry.
LAYERS = 'layers'
