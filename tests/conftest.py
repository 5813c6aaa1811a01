"""Test set-up: 8 simulated CPU devices, set before jax is first imported."""

import os

os.environ['XLA_FLAGS'] = ' '.join(
    [os.environ.get('XLA_FLAGS', ''),
     '--xla_force_host_platform_device_count=8']).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
