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

import re

from absl import flags
from flax import traverse_util
import matplotlib
import numpy as np

from model import attention, layer_stack
from model.families import FAMILIES
from train import cli
from train.base import storage
from train.base.errors import InputError
from train.base.train_config import TrainConfig
from train.data import datasets
from train.run import trained_run

matplotlib.use('Agg')
from matplotlib import pyplot as plt  # noqa: E402  (after choosing Agg)


FLAGS = flags.FLAGS


def tokens_to_draw(dataset: datasets.Dataset, config: TrainConfig,
                   text: str | None, example: int | None,
                   max_tokens: int) -> np.ndarray:
  if (text is None) == (example is None):
    raise InputError('give one of --text or --example.')
  if text is not None:
    if dataset.tokenizer is None:
      raise InputError(f'config.dataset={config.dataset!r} is not text; '
                       'use --example.')
    ids = dataset.tokenizer.encode(text)
    if dataset.task.documents:  # A document starts with EOS.
      ids = np.concatenate([[dataset.tokenizer.eos_id], ids])
  else:
    split = dataset.splits[config.eval_split]
    if not 0 <= example < len(split):
      raise InputError(f'--example={example} is not an index of the '
                       f'{len(split)} examples of {config.eval_split!r}.')
    record = split[example]
    ids = record[dataset.task.inputs_key]
  return np.asarray(ids, np.int32)[:max_tokens]


def attention_weights(model, params, tokens: np.ndarray
                      ) -> list[tuple[str, np.ndarray]]:
  """(layer name, weights [N, T, T]) of every self-attention layer that
  reads `tokens`, the model's inputs (an encoder-decoder's encoder's)."""
  method = FAMILIES[model.config.family].inputs_method
  _, variables = model.apply({'params': params}, tokens[None], method=method,
                             mutable=['intermediates'])
  # A scanned stack's maps are stacked over its groups: read per block.
  flat = traverse_util.flatten_dict(layer_stack.unstacked(
      variables['intermediates'], model.config.scan_group,
      model.config.scan_start), sep='/')
  # block_2 before block_10.
  in_order = lambda path: [int(part) if part.isdigit() else part
                           for part in re.split(r'(\d+)', path)]
  return [(path.rsplit('/', 2)[0], np.asarray(weights)[0])
          for path, (weights,) in sorted(flat.items(),
                                         key=lambda item: in_order(item[0]))]


def label(dataset: datasets.Dataset, token: int) -> str:
  if dataset.tokenizer is None:
    return str(token)
  if token == dataset.tokenizer.eos_id:
    return '<s>'
  text = repr(dataset.tokenizer.decode([token]))[1:-1]
  return text.replace(' ', '␣') or '·'


def draw(layers: list[tuple[str, np.ndarray]], labels: list[str],
         path: str) -> None:
  """One heatmap per layer (row) and head (column) on one colour scale,
  0 to the largest weight drawn, with its colourbar."""
  num_heads = layers[0][1].shape[0]
  size = 1.5 + 0.16 * len(labels)
  figure, axes = plt.subplots(
      len(layers), num_heads, squeeze=False, layout='constrained',
      figsize=(size * num_heads + 1.0, size * len(layers)))
  ticks = np.arange(len(labels))
  top = max(float(weights.max()) for _, weights in layers)
  for row, (name, weights) in enumerate(layers):
    for head in range(num_heads):
      ax = axes[row, head]
      image = ax.imshow(weights[head], cmap='viridis', vmin=0.0, vmax=top)
      ax.set_title(f'{name} head {head}', fontsize=9)
      ax.set_xticks(ticks, labels, fontsize=7, rotation=90)
      ax.set_yticks(ticks, labels, fontsize=7)
      ax.set(xlabel='key' if row == len(layers) - 1 else None,
             ylabel='query' if head == 0 else None)
  figure.colorbar(image, ax=axes, shrink=0.5, label='attention weight')
  with storage.path(path).open('wb') as f:  # The run's workdir may be gs://.
    figure.savefig(f, format='png', dpi=110)
  plt.close(figure)


def attention_maps(workdir: str, *, text: str | None = None,
                   example: int | None = None, output: str | None = None,
                   max_tokens: int = 48) -> str:
  """Draws the maps of the run in `workdir`; returns the PNG's path."""
  run = trained_run.load(workdir)
  family = FAMILIES[run.model_config.family]
  if family.inputs_method is None:
    raise InputError(f'config.model.family={family.name!r} has no '
                     'self-attention to draw.')
  for layer_config in run.model_config.layer_configs():
    if not attention.spec(layer_config.attention).exact:
      raise InputError(
          f'config.model.attention={layer_config.attention!r}: maps are '
          f'drawn for exact softmax attention '
          f'({", ".join(attention.exact_names())}).')
  tokens = tokens_to_draw(run.dataset, run.config, text, example, max_tokens)
  layers = attention_weights(run.model, run.params, tokens)
  labels = [label(run.dataset, int(t)) for t in tokens]
  if run.dataset.task.has_classes and run.model_config.pooling == 'cls':
    labels = ['[CLS]'] + labels  # The classifier's vector before the tokens.
  output = output or f'{storage.resolve(workdir)}/attention_maps.png'
  draw(layers, labels, output)
  return output


def main(argv: list[str]) -> None:
  path = cli.run_main(argv, lambda: attention_maps(
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
  cli.run(main, _define_flags)
