"""Test set-up: 8 simulated CPU devices, set before jax is first imported."""

import os

os.environ['XLA_FLAGS'] = ' '.join(
    [os.environ.get('XLA_FLAGS', ''),
     '--xla_force_host_platform_device_count=8']).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import pytest


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory) -> str:
  """One data_dir for the whole session: each dataset is built once."""
  return str(tmp_path_factory.mktemp('data'))


@pytest.fixture(scope='session')
def stdlib_dataset(data_dir):
  from configs import default
  from train.data import datasets
  config = default.get_config()
  config.data_dir = data_dir
  return datasets.load(config, workdir=data_dir)
