"""The test set-up itself."""

import jax
import pytest


@pytest.mark.core
def test_conftest_simulates_eight_devices():
  assert jax.device_count() == 8
