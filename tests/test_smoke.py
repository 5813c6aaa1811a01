"""The set-up itself: simulated devices and the `make train` entry point."""

import jax

from train import smoke


def test_conftest_simulates_eight_devices():
  assert jax.device_count() == 8


def test_smoke_run_passes(capsys):
  smoke.main()
  assert 'smoke run passed' in capsys.readouterr().out
