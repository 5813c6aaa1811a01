"""Byte-level DecoderLM on the Python standard library (`make train`).

  python -m train.train --config=configs/lm_stdlib.py --workdir=workdirs/lm_stdlib

A first look in about a minute (47 s on 2 CPU cores, dataset built; the
warmup is cut short, with a warning):

  make train WORKDIR=/tmp/smoke ARGS=--config.num_train_steps=20

Result on 2 CPU cores: validation 2.24 bits per byte (eval_loss 1.55 nats)
after 550 steps (2.236 when last measured), 8m14s for `make train` on a
fresh clone, installation included (8m37s in the last run, with .venv
and the dataset in place, on a slower machine); the sample it prints is
Python-shaped but not yet Python.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = 'python_stdlib_bytes'
  config.seq_len = 256
  config.batch_size = 32
  config.num_train_steps = 550
  config.learning_rate = 3e-3
  config.warmup_steps = 50
  config.eval_every = 275
  config.checkpoint_every = 275
  config.sample_length = 300
  config.sample_prompt = 'def '

  config.model.family = 'decoder_lm'
  config.model.vocab_size = 258  # 256 bytes, padding and end of sequence.
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.num_layers = 4
  config.model.mlp_dim = 512
  config.model.max_len = config.seq_len
  return config
