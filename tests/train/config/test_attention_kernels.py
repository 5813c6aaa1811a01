"""The kernel each self-attention of a config runs, worked out from the
config: by family, packing, dtype and backend."""

import pytest

from configs import listops, lm_stdlib, wmt14_ende
from model import ModelConfig
from model.attention import fused
from train.base.errors import InputError
from train.config import attention_kernels
from train.config import validation as config_validation


def summary(config, backend):
  found = attention_kernels.choices(
      config, ModelConfig.from_mapping(config.model), config.seq_len,
      backend)
  return [(c.stack, c.layers, c.case.mask, c.case.is_causal, c.kernel)
          for c in found]


@pytest.mark.core
def test_each_family_asks_its_own_cases():
  lm = lm_stdlib.get_config('baseline')  # Sinusoidal: no bias to refuse.
  lm.model.update(attention='chunked', dtype='bfloat16')
  layers = (0, 1, 2, 3)
  # Packed rows: Pallas on either accelerator, never cuDNN.
  assert summary(lm, 'gpu') == [('decoder', layers, 'segments', True,
                                 'pallas_gpu')]
  assert summary(lm, 'tpu')[0][-1] == 'pallas_tpu'
  assert summary(lm, 'cpu')[0][-1] == 'xla'
  lm.pack_sequences = False
  assert summary(lm, 'gpu')[0][2:] == ('none', True, 'cudnn')
  # Encoder-decoder: padded source rows, then a causal decoder.
  wmt = wmt14_ende.get_config()
  wmt.model.attention = 'chunked'
  encoder, decoder = summary(wmt, 'gpu')
  assert encoder[0] == 'encoder' and encoder[2:] == ('key_padding', False,
                                                     'cudnn')
  assert decoder[0] == 'decoder' and decoder[2:] == ('none', True, 'cudnn')
  wmt.model.dtype = 'float32'  # cuDNN takes half precision only.
  assert [row[-1] for row in summary(wmt, 'gpu')] == ['xla', 'pallas_gpu']
  # A pattern: only the entries that take a kernel, each on its layers.
  classifier = listops.get_config()
  classifier.model.update(attention='dense,local', num_layers=4)
  (local,) = summary(classifier, 'tpu')
  assert local == ('encoder', (1, 3), 'key_padding', False, 'pallas_tpu')
  # Dense takes no kernel option.
  classifier.model.attention = 'dense'
  assert summary(classifier, 'tpu') == []


def test_packed_rows_take_cudnn_on_hopper_and_newer(monkeypatch):
  """On a GPU the trainer's packed LM rows go to cuDNN's packed layout where
  the device is sm90 or newer (faked here), to Pallas before that."""
  lm = lm_stdlib.get_config('baseline')
  lm.model.update(attention='chunked', dtype='bfloat16')
  for capability, kernel in (('9.0', 'cudnn'), ('8.0', 'pallas_gpu')):
    monkeypatch.setattr(fused, 'device_description',
                        lambda capability=capability: ('gpu', capability))
    (choice,) = attention_kernels.choices(
        lm, ModelConfig.from_mapping(lm.model), lm.seq_len)
    assert (choice.case.mask, choice.kernel) == ('segments', kernel)
    assert choice.case.max_segments == lm.model.max_segments_per_row + 1


def test_alibi_layers_run_the_alibi_kernels_on_a_gpu_or_tpu():
  """make train's model: ALiBi, attention 'auto' (chunked)."""
  config = lm_stdlib.get_config()
  model_config = ModelConfig.from_mapping(config.model)
  for backend in ('gpu', 'tpu'):
    found = attention_kernels.choices(config, model_config, config.seq_len,
                                      backend)
    assert found and {(c.case.bias, c.kernel) for c in found} == {
        ('alibi', f'pallas_{backend}')}
    assert found[0].describe().endswith("ALiBi's bias)")


def test_a_length_split_over_the_mesh_refuses_a_named_fused_kernel():
  lm = lm_stdlib.get_config('baseline')
  lm.model.update(attention='chunked',
                  attention_options={'kernel': 'pallas_tpu'})
  lm.parallelism.update(data=4, sequence=2)
  with pytest.raises(InputError, match=(
      r"config.model.attention_options.kernel='pallas_tpu' cannot split "
      r'the length over 2 devices \(sequence parallelism')):
    config_validation.check(lm)
  lm.model.attention_options = {}
  (choice,) = attention_kernels.choices(
      lm, ModelConfig.from_mapping(lm.model), lm.seq_len, 'tpu')
  assert choice.kernel == 'xla'
