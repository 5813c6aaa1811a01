r"""The RNN encoder-decoder with attention (Bahdanau et al. 2015) on an
algorithmic task, with configs/algorithmic.py's data, steps and decoding:

  python -m train.train --config=configs/rnn_attention.py:task=reverse \
      --workdir=workdirs/rnn_reverse

A bidirectional LSTM encoder and an attending LSTM decoder of width 128
(`config.model.rnn_cell='gru'`, `config.model.rnn_score='general'` for
the others). `python -m experiments.bench_seq2seq` times its train step
against the Transformer's as the length grows.

Results: docs/configs.md, `rnn_attention.py`.
"""

from configs import algorithmic


def get_config(arg: str = 'task=reverse'):
  """`arg` is `task=<name>`, one of algorithmic.TASKS."""
  config = algorithmic.get_config(arg)
  config.model.family = 'rnn_attention'
  config.model.rnn_cell = 'lstm'
  config.model.rnn_score = 'additive'
  return config
