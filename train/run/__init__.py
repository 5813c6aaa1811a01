"""A training run: the Program compiled from a checked config (program),
the loop (trainer), the workdir that belongs to one run and one config
(workdir), verified checkpoints (checkpointing), preemption, the metrics
written and summarised (metrics), what a workdir holds to be read
anywhere (portable), and a finished run reopened from its workdir
(trained_run). Imports every room before it."""
