"""The Transformer (base) on WMT14 English-German (tfds
`wmt14_translate/de-en`), for accelerators.

  python -m train.train --config=configs/wmt14_ende.py --workdir=workdirs/wmt14

Needs the dataset prepared in config.data_dir (array_record; preparing it
needs TensorFlow once, see docs/training.md). A joint SentencePiece
vocabulary is trained from the training split on first use unless
config.vocab_path names one. Result: not measured on this machine, which
cannot download the dataset; the pipeline is tested offline on a small
local dataset with the same features.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = 'wmt14_translate/de-en'
  config.dataset_options.source_language = 'en'
  config.dataset_options.target_language = 'de'
  config.seq_len = 256
  config.batch_size = 256
  config.num_train_steps = 100_000
  # Vaswani et al. 2017: peak d_model^-0.5 * warmup^-0.5, then rsqrt decay.
  config.schedule = 'rsqrt'
  config.warmup_steps = 4000
  config.learning_rate = 512**-0.5 * 4000**-0.5
  config.label_smoothing = 0.1
  config.weight_decay = 0.0
  config.eval_every = 2000
  config.num_eval_steps = 50
  config.checkpoint_every = 2000
  # BLEU of the whole validation split (newstest2013), beam 4, alpha 0.6.
  config.decode_splits = ('validation',)
  config.num_decode_examples = -1
  config.log_every = 100

  config.model.family = 'encoder_decoder'
  config.model.vocab_size = 32_000
  config.model.d_model = 512
  config.model.num_heads = 8
  config.model.num_layers = 6
  config.model.mlp_dim = 2048
  config.model.mlp_activation = 'relu'
  config.model.norm_position = 'post'
  config.model.dropout_rate = 0.1
  config.model.max_len = config.seq_len
  config.model.dtype = 'bfloat16'
  return config
