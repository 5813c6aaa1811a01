"""DecoderLM on the One Billion Word benchmark (tfds `lm1b`), for accelerators.

  python -m train.train --config=configs/lm1b.py --workdir=workdirs/lm1b

Needs `lm1b` prepared in config.data_dir (array_record; see docs/training.md). A
SentencePiece vocabulary of config.model.vocab_size pieces is trained from
the training split on first use unless config.vocab_path names one.
Result: not measured on this machine, which cannot download the dataset;
the pipeline is tested offline on tfds mock data.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = 'lm1b'
  config.seq_len = 128
  config.batch_size = 256
  config.num_train_steps = 100_000
  config.learning_rate = 1e-3
  config.warmup_steps = 1000
  config.weight_decay = 0.1
  # lm1b has no validation split.
  config.eval_split = 'test'
  config.eval_every = 2000
  config.num_eval_steps = 100
  config.checkpoint_every = 2000
  config.log_every = 100
  config.sample_length = 64
  config.sample_prompt = 'The'

  config.model.family = 'decoder_lm'
  config.model.vocab_size = 32_000
  config.model.d_model = 512
  config.model.num_heads = 8
  config.model.num_layers = 6
  config.model.mlp_dim = 2048
  config.model.dropout_rate = 0.1
  config.model.max_len = config.seq_len
  config.model.dtype = 'bfloat16'
  return config
