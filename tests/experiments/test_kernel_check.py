"""experiments/kernel_check.py on the CPU: the Pallas kernels, interpreted,
agree with the dense core on the check's cases; a kernel that computes
wrongly or does not compile is reported as failed, and a kernel that
cannot take a case is skipped with the reason rather than replaced."""

import json

import pytest

from experiments import kernel_check
from model.attention.kernels import fused_kernels

# About 3 s a case (one compile, interpreted). On the GPU's kernels (64
# positions), in bfloat16, the dtype with the least room: flash's own path
# and the general kernel's scores, cap, sinks and patterns, T5's table
# gradient, ALiBi's and the sinks'; on the TPU's, splash's own paths and
# the general kernel's windows and BigBird's blocks of 128, in float32.
SELECTIONS = {
    'pallas_gpu': (('plain', 'packed', 't5_padded', 'logit_cap',
                    'bigbird_alibi', 'windows_alibi', 'sinks_packed'),
                   'bfloat16'),
    'pallas_tpu': (('plain', 'bigbird', 'bigbird_alibi', 'windows_alibi'),
                   'float32'),
}


@pytest.mark.parametrize('kernel', SELECTIONS)
def test_every_case_agrees_with_dense_on_the_cpu(kernel):
  cases, dtype = SELECTIONS[kernel]
  rows = kernel_check.check('cpu', kernels=[kernel], cases=cases,
                            dtypes=[dtype])
  expected = [name for name in cases
              if kernel in kernel_check.CASES[name].kernels]
  assert [row['case'] for row in rows] == expected
  for row in rows:
    assert row['ok'] is True, row
    assert row['out_error'] <= row['tolerance'], row
  # The score functions' data and the sinks have gradients, and only they.
  has_data = {row['case']: 'd_data_error' in row for row in rows}
  assert has_data == {name: kernel_check.CASES[name].score is not None
                      or kernel_check.CASES[name].sinks for name in expected}


def test_a_kernel_that_computes_wrongly_is_reported_as_failed(
    monkeypatch, tmp_path):
  """Pallas flash attention that loses the causal mask, as a
  miscompiled kernel might: its row fails, and the JSON names it."""
  flash = fused_kernels.pallas_gpu
  monkeypatch.setattr(fused_kernels, 'pallas_gpu',
                      lambda *args, is_causal, **kwargs: flash(
                          *args, is_causal=False, **kwargs))
  [row] = kernel_check.run(str(tmp_path), kernels=['pallas_gpu'],
                           cases=['plain'], dtypes=['float32'])
  assert row['ok'] is False and row['out_error'] > 0.1
  with open(tmp_path / kernel_check.FAILED_FILE) as f:
    assert json.load(f) == {'pallas_gpu': ['plain float32']}
  assert kernel_check.read_failed(str(tmp_path)) == {
      'pallas_gpu': ['plain float32']}
  with open(tmp_path / 'results.md') as f:
    text = f.read()
  assert 'Failed: pallas_gpu (plain float32)' in text
  assert '| pallas_gpu | plain | float32 |' in text


def test_a_kernel_that_does_not_compile_is_reported_as_failed(monkeypatch):
  def fails(*args, **kwargs):
    raise ValueError('Mosaic failed to compile the kernel.\nMore lines.')
  monkeypatch.setattr(fused_kernels, 'splash', fails)
  [row] = kernel_check.check('cpu', kernels=['pallas_tpu'], cases=['plain'],
                             dtypes=['float32'])
  assert row['ok'] is False
  assert row['error'] == 'ValueError: Mosaic failed to compile the kernel.'
  assert kernel_check.failed_kernels([row]) == {
      'pallas_tpu': ['plain float32']}


def test_a_case_a_kernel_refuses_is_skipped_with_the_reason():
  """cuDNN's cases on the CPU: skipped as fused.refusal says, nothing
  compiled or run by another kernel."""
  rows = kernel_check.check('cpu', kernels=['cudnn'], cases=['plain'],
                            dtypes=['bfloat16'])
  assert [row['skipped'] for row in rows] == [
      'needs a GPU (bfloat16, causal)']
  assert 'ok' not in rows[0]


def test_no_verdict_is_read_where_the_check_wrote_none(tmp_path):
  assert kernel_check.read_failed(str(tmp_path)) is None
