"""Experiments on train_and_evaluate: comparisons, sweeps, launchers, maps."""
