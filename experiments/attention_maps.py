"""Draws the attention weights of every layer and head of a trained model.

  python -m experiments.attention_maps --workdir=DIR --text="def f(x):"
  python -m experiments.attention_maps --workdir=DIR --example=3

Loads the run's config and latest checkpoint from DIR, feeds it the text
(language models: after the end-of-sequence id that starts a document) or
example N of the evaluation split (`inputs` of seq2seq and classification
data: the encoder's self-attention), and saves a grid of heatmaps, a row per
layer and a column per head, queries down and keys across, tokens on the
axes, to DIR/attention_maps.png (or --output).

The weights drawn are the softmax weights under each layer's mask, which
are what `dense`, `chunked` and `ring` attend with; other variants attend
with approximations or patterns of their own, so they are refused.
"""

import json
import os
import re

from absl import app
from absl import flags
from flax import traverse_util
import jax
import matplotlib
import ml_collections
import numpy as np

from experiments import common
from model import build
from train import checkpointing, config_validation, mesh, parallel
from train.data import datasets, tokenizers
from train.errors import InputError

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)


FLAGS = flags.FLAGS
EXACT = ('dense', 'chunked', 'ring')


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a run was trained with, on one device (whatever the mesh
  it trained on: the checkpoint is restored into one device's layout)."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise InputError(f'{path} does not exist: --workdir must be a training '
                     'run\'s workdir.')
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  config.parallelism.update(data=-1, fsdp=1, tensor=1, sequence=1,
                            strategy='pjit', dcn_data=1)
  config.distributed = False
  # JSON has no tuples: pairs come back as lists.
  config.logical_axis_rules = tuple(
      (name, tuple(target) if isinstance(target, list) else target)
      for name, target in config.logical_axis_rules)
  return config


def tokens_to_draw(dataset: datasets.Dataset, config, text: str | None,
                   example: int | None, max_tokens: int) -> np.ndarray:
  if (text is None) == (example is None):
    raise InputError('give one of --text or --example.')
  if text is not None:
    if dataset.tokenizer is None:
      raise InputError(f'config.dataset={config.dataset!r} is not text; '
                       'use --example.')
    ids = dataset.tokenizer.encode(text)
    if dataset.kind == 'lm':
      ids = np.concatenate([[tokenizers.EOS_ID], ids])
  else:
    split = dataset.splits[config.eval_split]
    if not 0 <= example < len(split):
      raise InputError(f'--example={example} is not an index of the '
                       f'{len(split)} examples of {config.eval_split!r}.')
    record = split[example]
    ids = record['tokens' if dataset.kind == 'lm' else 'inputs']
  return np.asarray(ids, np.int32)[:max_tokens]


def attention_weights(model, params, kind: str, tokens: np.ndarray
                      ) -> list[tuple[str, np.ndarray]]:
  """(layer name, weights [N, T, T]) of every self-attention layer."""
  row = tokens[None]
  if kind == 'seq2seq':
    _, variables = model.apply({'params': params}, row, method='encode',
                               mutable=['intermediates'])
  else:
    _, variables = model.apply({'params': params}, row,
                               mutable=['intermediates'])
  flat = traverse_util.flatten_dict(variables['intermediates'], sep='/')
  # block_2 before block_10.
  in_order = lambda path: [int(part) if part.isdigit() else part
                           for part in re.split(r'(\d+)', path)]
  return [(path.rsplit('/', 2)[0], np.asarray(weights)[0])
          for path, (weights,) in sorted(flat.items(),
                                         key=lambda item: in_order(item[0]))]


def label(dataset: datasets.Dataset, token: int) -> str:
  if dataset.tokenizer is None:
    return str(token)
  if token == tokenizers.EOS_ID:
    return '<s>'
  text = repr(dataset.tokenizer.decode([token]))[1:-1]
  return text.replace(' ', '␣') or '·'


def draw(layers: list[tuple[str, np.ndarray]], labels: list[str],
         path: str) -> None:
  num_heads = layers[0][1].shape[0]
  size = 1.2 + 0.12 * len(labels)
  figure, axes = plt.subplots(len(layers), num_heads, squeeze=False,
                              figsize=(size * num_heads, size * len(layers)))
  ticks = np.arange(len(labels))
  for row, (name, weights) in enumerate(layers):
    for head in range(num_heads):
      ax = axes[row, head]
      ax.imshow(weights[head], cmap='viridis', vmin=0.0)
      ax.set_title(f'{name} head {head}', fontsize=7)
      ax.set_xticks(ticks, labels, fontsize=5, rotation=90)
      ax.set_yticks(ticks, labels, fontsize=5)
  figure.tight_layout()
  figure.savefig(path, dpi=130)
  plt.close(figure)


def attention_maps(workdir: str, *, text: str | None = None,
                   example: int | None = None, output: str | None = None,
                   max_tokens: int = 48) -> str:
  """Draws the maps of the run in `workdir`; returns the PNG's path."""
  config = load_config(workdir)
  model_config = config_validation.validate(config)
  if model_config.attention not in EXACT:
    raise InputError(
        f'config.model.attention={model_config.attention!r}: maps are drawn '
        f'for exact softmax attention ({", ".join(EXACT)}).')
  dataset = datasets.load(config, workdir)
  tokens = tokens_to_draw(dataset, config, text, example, max_tokens)
  program = parallel.compile_program(
      config, model_config, dataset.kind,
      mesh.make_mesh(config.parallelism, jax.devices()[:1]))
  checkpointer = checkpointing.Checkpointer(
      workdir, keep=config.keep_checkpoints, read_only=True)
  step = checkpointer.latest_step()
  if step is None:
    raise InputError(f'{workdir} has no checkpoint yet.')
  state = checkpointer.restore_state(step, program.abstract_state)
  checkpointer.close()
  layers = attention_weights(build(model_config), state.params, dataset.kind,
                             tokens)
  labels = [label(dataset, int(t)) for t in tokens]
  if dataset.kind == 'classification' and model_config.pooling == 'cls':
    labels = ['[CLS]'] + labels  # The classifier's vector before the tokens.
  output = output or os.path.join(workdir, 'attention_maps.png')
  draw(layers, labels, output)
  return output


def main(argv: list[str]) -> None:
  path = common.run_script(argv, lambda: attention_maps(
      FLAGS.workdir, text=FLAGS.text, example=FLAGS.example,
      output=FLAGS.output, max_tokens=FLAGS.max_tokens))
  print(f'Wrote {path}')


def _define_flags() -> None:
  """The command line, defined only when this runs as a script (so that
  the experiment modules can be imported together)."""
  flags.DEFINE_string('workdir', None, 'A training run\'s workdir.')
  flags.DEFINE_string('text', None, 'Text to feed the model.')
  flags.DEFINE_integer(
      'example', None, 'Index of an evaluation example (instead of --text).')
  flags.DEFINE_string(
      'output', None, 'PNG to write; default DIR/attention_maps.png.')
  flags.DEFINE_integer('max_tokens', 48,
                       'Tokens drawn at most (the first ones).')
  flags.mark_flag_as_required('workdir')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
