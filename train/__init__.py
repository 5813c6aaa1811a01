"""Training: the command lines, and the rooms they are composed of.

Each room imports only from the rooms listed before it (and from model/):

  base/      the training config (TrainConfig: every key, its default and
             rule), the error types a mistake becomes, silenced library
             notices, how the hosts of a run agree
  data/      datasets, tokenizers, packing, and the tasks they pose
  program/   what a compiled step is made of: the mesh and sharding, the
             loss and step functions, the optimizer, FLOPs, device memory
  decode/    decoding from a model (greedy, sampling, beam search) and
             scoring what it decodes
  config/    a user's config checked against the data, the model, the
             mesh and the kernels its layers choose before anything
             compiles, and made a TrainConfig
  run/       a training run: the Program compiled from a checked config,
             the loop, its workdir, checkpoints, preemption and metrics;
             a finished run reopened; parameters taken from another run
             (init_from) or from a published checkpoint (pretrained)

The modules here are the command lines (`python -m train.train`,
`train.generate`, `train.translate`) and what they share (cli).
"""
