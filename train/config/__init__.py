"""A user's config checked before anything compiles: every key by its rule
and the model on its data (validation), its layout on the mesh (layout),
the kernel each self-attention chooses, traced (kernels); a mistake is an
InputError naming the key, and a config that passes is a TrainConfig.
Imports train.base, train.data, train.program and train.decode."""
