"""The kernel each self-attention of a config runs, learnt by tracing the
model on the task's batches: by family, packing, dtype and backend (other
backends than this CPU's faked where fused.py reads the device)."""

import pytest

from configs import listops, lm_stdlib, wmt14_ende
from model.attention.kernels import fused
from train.base.errors import InputError
from train.config import kernels, validation as config_validation


def traced(config, monkeypatch, backend, capability=None):
  """The config's kernels, grouped, as a `backend` device would choose."""
  monkeypatch.setattr(fused, 'device_description',
                      lambda: (backend, capability))
  checked = config_validation.check(config)
  return kernels.grouped(checked.config, checked.kernels)


def summary(config, monkeypatch, backend):
  return [(c.stack, c.layers, c.case.mask, c.case.is_causal, c.kernel)
          for c in traced(config, monkeypatch, backend)]


@pytest.mark.core
def test_each_family_asks_its_own_cases(monkeypatch):
  lm = lm_stdlib.get_config('baseline')  # Sinusoidal: no bias to refuse.
  lm.model.update(attention='chunked', dtype='bfloat16')
  layers = (0, 1, 2, 3)
  # Packed rows: Pallas on either accelerator, never cuDNN.
  assert summary(lm, monkeypatch, 'gpu') == [
      ('decoder', layers, 'segments', True, 'pallas_gpu')]
  assert summary(lm, monkeypatch, 'tpu')[0][-1] == 'pallas_tpu'
  assert summary(lm, monkeypatch, 'cpu')[0][-1] == 'xla'
  lm.pack_sequences = False
  assert summary(lm, monkeypatch, 'gpu')[0][2:] == ('none', True, 'cudnn')
  # Encoder-decoder: padded source rows, then a causal decoder.
  wmt = wmt14_ende.get_config()
  wmt.model.attention = 'chunked'
  encoder, decoder = summary(wmt, monkeypatch, 'gpu')
  assert encoder[0] == 'encoder' and encoder[2:] == ('key_padding', False,
                                                     'cudnn')
  assert decoder[0] == 'decoder' and decoder[2:] == ('none', True, 'cudnn')
  wmt.model.dtype = 'float32'  # cuDNN takes half precision only.
  # Padded source rows, in float32: the general kernel.
  assert [row[-1] for row in summary(wmt, monkeypatch, 'gpu')] == [
      'pallas_gpu', 'pallas_gpu']
  # A pattern: only the entries that take a kernel, each on its layers.
  classifier = listops.get_config()
  classifier.model.update(attention='dense,local', num_layers=4)
  (local,) = summary(classifier, monkeypatch, 'tpu')
  assert local == ('encoder', (1, 3), 'key_padding', False, 'pallas_tpu')
  # Scanned, the loop's one traced local block stands for both layers.
  classifier.model.scan_layers = True
  assert summary(classifier, monkeypatch, 'tpu') == [local]
  # Dense takes no kernel option.
  classifier.model.attention = 'dense'
  assert summary(classifier, monkeypatch, 'tpu') == []


def test_packed_rows_take_cudnn_on_hopper_and_newer(monkeypatch):
  """On a GPU the trainer's packed LM rows go to cuDNN's packed layout where
  the device is sm90 or newer (faked here), to Pallas before that."""
  lm = lm_stdlib.get_config('baseline')
  lm.model.update(attention='chunked', dtype='bfloat16')
  for capability, kernel in (('9.0', 'cudnn'), ('8.0', 'pallas_gpu')):
    (choice,) = traced(lm, monkeypatch, 'gpu', capability)
    assert (choice.case.mask, choice.kernel) == ('segments', kernel)
    assert choice.case.max_segments == lm.model.max_segments_per_row + 1


def test_alibi_layers_run_the_general_kernel_on_a_gpu_or_tpu(monkeypatch):
  """make train's model: ALiBi, local windows of the whole row (chunked)
  and of 64 tokens by layer, each on the general kernel."""
  config = lm_stdlib.get_config()
  for backend in ('gpu', 'tpu'):
    found = traced(config, monkeypatch, backend)
    assert found and {(c.case.bias, c.kernel) for c in found} == {
        ('function', f'pallas_{backend}')}
    assert found[0].describe().endswith("ALiBi's bias)")


def test_a_length_split_over_the_mesh_refuses_a_named_fused_kernel(
    monkeypatch):
  lm = lm_stdlib.get_config('baseline')
  lm.model.update(attention='chunked',
                  attention_options={'kernel': 'pallas_tpu'})
  lm.parallelism.update(data=4, sequence=2)
  with pytest.raises(InputError, match=(
      r"config.model.attention_options.kernel='pallas_tpu' cannot split "
      r'the length over 2 devices \(sequence parallelism')):
    config_validation.check(lm)
  lm.model.attention_options = {}
  (choice,) = traced(lm, monkeypatch, 'tpu')
  assert choice.kernel == 'xla'


def test_a_named_kernel_that_cannot_compute_a_layer_is_refused_by_key():
  """cuDNN on this CPU: refused, naming the option of that attention in a
  pattern, its stack and the case the trace found."""
  config = lm_stdlib.get_config('baseline')
  config.model.update(attention='dense,chunked', num_layers=2,
                      attention_options={'chunked': {'kernel': 'cudnn'}})
  with pytest.raises(InputError) as error:
    config_validation.check(config)
  assert str(error.value).startswith(
      "config.model.attention_options.chunked.kernel='cudnn' ")
  assert str(error.value).endswith(
      "the decoder's self-attention is float32, causal, packed rows on "
      "cpu; set it to 'auto'.")


def test_a_refusal_names_the_kernel_key_as_it_was_typed():
  """One attention, its option set under its name: the error names that
  key, not the flat one."""
  config = lm_stdlib.get_config()  # ALiBi.
  config.sample_length = 0
  config.model.attention = 'bigbird'
  config.model.attention_options = {
      'bigbird': {'kernel': 'pallas_gpu', 'block': 8}}
  with pytest.raises(InputError, match=(
      r"^config.model.attention_options.bigbird.kernel='pallas_gpu' takes "
      "bigbird's block as its tile")):
    config_validation.check(config)
  config.model.attention_options = {'kernel': 'palas_gpu'}
  with pytest.raises(InputError, match=(
      r"^config.model.attention_options.kernel='palas_gpu' must be")):
    config_validation.check(config)


def test_a_pallas_kernel_on_the_cpu_is_said_to_run_interpreted():
  config = lm_stdlib.get_config('baseline')
  config.model.update(attention='chunked',
                      attention_options={'kernel': 'pallas_gpu'})
  checked = config_validation.check(config)
  (named,) = kernels.grouped(checked.config, checked.kernels)
  assert named.describe() == (
      'decoder layers 0,1,2,3 chunked: pallas_gpu (as set; float32, causal, '
      'packed rows; interpreted on the CPU: slow, for tests)')
  config.model.attention_options = {}
  checked = config_validation.check(config)
  (auto,) = kernels.grouped(checked.config, checked.kernels)
  assert 'interpreted' not in auto.describe()


def test_a_window_per_occurrence_gives_each_local_layer_its_kernel(
    monkeypatch):
  """'local,local' with windows (256, 64) on rows of 256: two groups of
  layers, each on a fused kernel, the first as chunked attention (its
  window covers the row), the second with its window."""
  config = lm_stdlib.get_config('baseline')
  config.sample_length = 0  # Local attention reads no key/value cache.
  config.model.update(attention='local,local', dtype='bfloat16')
  config.model.attention_options = {'local': {'window': (256, 64)}}
  for backend, fused_kernels in (('gpu', {'cudnn', 'pallas_gpu'}),
                                 ('tpu', {'pallas_tpu'})):
    found = traced(config, monkeypatch, backend)
    assert [(c.attention, c.layers, c.case.window) for c in found] == [
        ('local', (0, 2), None), ('local', (1, 3), 64)]
    assert {c.kernel for c in found} <= fused_kernels, backend
