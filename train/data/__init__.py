"""The data of a run: datasets built locally and their tokenizers, the
task each poses (tasks: the batch's form, the loss and the quality metric),
packing and padding into rows (layouts), and the checkpointable input
pipeline. Imports train.base."""
