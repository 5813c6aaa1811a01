"""Every config at toy size, for the tests that train: a few steps of a
one-layer model on small local data; and a run's workdir written without
training."""

import json
import os
import pathlib

import tensorflow_datasets as tfds

from configs import algorithmic, default, listops, lm1b, lm_stdlib, mqar
from configs import wmt14_ende
from train.run import checkpointing


def shrink(config, data_dir: str, **overrides):
  """The config at toy size: a few steps of a one-layer model."""
  config.data_dir = data_dir
  config.batch_size = 8
  config.num_train_steps = 4
  config.warmup_steps = 1
  config.log_every = 2
  config.eval_every = 2
  config.checkpoint_every = 2
  config.num_eval_steps = 2
  config.num_decode_examples = 8
  config.sample_length = min(config.sample_length, 4)
  config.model.update(d_model=16, num_heads=2, num_layers=1, mlp_dim=32,
                      dtype='float32')
  config.update(overrides)
  config.model.max_len = config.seq_len + 1
  return config


class LocalWmt14(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A few sentence pairs with the features of wmt14_translate/de-en."""

  name = 'wmt14_translate'
  VERSION = tfds.core.Version('1.0.0')
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name='de-en')]

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.Translation(languages=('de', 'en')))

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples(range(200)),
            'validation': self._generate_examples(range(200, 220)),
            'test': self._generate_examples(range(220, 240))}

  def _generate_examples(self, indices):
    numbers = ['null', 'eins', 'zwei', 'drei', 'vier', 'fuenf']
    english = ['zero', 'one', 'two', 'three', 'four', 'five']
    for i in indices:
      digits = [int(d) % 6 for d in str(i)]
      yield i, {'de': 'die zahl ' + ' '.join(numbers[d] for d in digits),
                'en': 'the number ' + ' '.join(english[d] for d in digits)}


def tiny_config(name: str, data_dir: str):
  if name == 'lm_stdlib':
    config = shrink(lm_stdlib.get_config(), data_dir, seq_len=32)
    # One layer of 32 tokens: of the default's windows by layer only the
    # first applies, the whole row (chunked attention, as 'auto' runs
    # it), and there is no first layer's values to mix into a later one's.
    # Left out, so that a test may set another attention or several layers
    # alone.
    config.model.attention = 'auto'
    config.model.attention_options = default.attention_options()
    config.model.value_residual = False
    return config
  if name == 'algorithmic':
    config = shrink(algorithmic.get_config('task=addition'), data_dir,
                    seq_len=16)
    config.dataset_options.update(num_train=200, num_eval=20, max_length=8,
                                  long_max_length=12)
    return config
  if name == 'mqar':
    # Two layers (recall takes a layer that finds the key's earlier place
    # and one that reads the value after it) of 4-pair recall, which a
    # dense model learns in a few hundred steps.
    config = shrink(mqar.get_config('length=32,pairs=4'), data_dir,
                    seq_len=32, batch_size=32, learning_rate=3e-3)
    config.dataset_options.update(vocab_size=64, num_train=10_000,
                                  num_eval=64)
    config.model.update(vocab_size=64, d_model=64, num_layers=2,
                        mlp_dim=128, position='rope')
    return config
  if name == 'listops':
    config = shrink(listops.get_config(), data_dir, seq_len=32)
    config.dataset_options.update(min_length=5, max_length=32, num_train=200,
                                  num_eval=20)
    return config
  if name == 'lm1b':
    config = shrink(lm1b.get_config(), data_dir, seq_len=16)
    config.model.vocab_size = 64
    return config
  config = shrink(wmt14_ende.get_config(), data_dir, seq_len=16,
                  warmup_steps=2)
  config.model.vocab_size = 64
  return config


def read_metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


# A config file of tiny_config('listops'), for the trials of sweeps and
# studies, which read their config from a file.
TINY_LISTOPS = '''
from configs import grid, listops, search


def get_config():
  config = listops.get_config()
  config.data_dir = {data_dir!r}
  config.update(batch_size=8, num_train_steps={steps}, warmup_steps=1,
                log_every={log_every}, eval_every={eval_every},
                checkpoint_every={checkpoint_every}, num_eval_steps=2,
                seq_len=32)
  config.model.update(d_model=16, num_heads=2, num_layers=1, mlp_dim=32,
                      max_len=33, dtype='float32')
  config.dataset_options.update(min_length=5, max_length=32, num_train=200,
                                num_eval=20)
  return config
'''


class _NoData:
  """A data iterator with no position (a checkpoint's 'data' item)."""

  def get_state(self) -> dict:
    return {}


def saved_run(config, workdir, states: dict) -> None:
  """A run's workdir without training: `config`'s config.json and a
  checkpoint of each {step: train state}, as a run writes them."""
  checkpointer = checkpointing.Checkpointer(str(workdir),
                                            keep=len(states))
  for step, state in states.items():
    checkpointer.save(step, state, _NoData())
  checkpointer.close()
  (pathlib.Path(workdir) / 'config.json').write_text(
      config.to_json_best_effort())
