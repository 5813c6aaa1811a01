"""The benchmark scripts run at tiny sizes, so that they cannot rot; what
they measure (speed) is never asserted here."""

import csv
import json
import os

from absl import flags
import jax
import jax.numpy as jnp
import pytest

from configs import algorithmic, lm_stdlib
from experiments import (attention_cases, bench_attention, bench_compile,
                         bench_input, bench_seq2seq, bench_train, common)
from model import attention
from model.attention.variants import sparse
from tests.helpers.sparse_patterns import bigbird_pattern
from train.base.errors import InputError

PNG = b'\x89PNG'


def test_bench_attention_measures_skips_and_writes_its_results(tmp_path):
  # Pallas's GPU kernels (the general kernel, under T5's bias or the cap,
  # needs heads of 16) run interpreted on CPU; cuDNN's refuses.
  rows = bench_attention.run(
      str(tmp_path), variants=['xla', 'chunked', 'chunked[pallas_gpu]',
                               'chunked[cudnn]', 'linformer', 'ring'],
      lengths=[16], options={'chunked': {'chunk_size': 8}}, causal=True,
      batch=1, heads=2, head_dim=16, dtype='float32', reps=1,
      max_seconds=60.0, rows=['packed', 't5', 'capped'])
  [directory] = [entry.path for entry in os.scandir(tmp_path)]
  with open(os.path.join(directory, 'results.jsonl')) as f:
    lines = [json.loads(line) for line in f]
  assert lines == rows and len(rows) == 18
  measured = {(row['rows'], row['variant']): row for row in rows
              if 'fwd_bwd_s' in row}
  assert set(measured) == {
      (kind, name) for kind in ('packed', 't5', 'capped')
      for name in ('xla', 'chunked', 'chunked[pallas_gpu]')}
  for row in measured.values():
    assert row['fwd_s'] > 0 and row['fwd_bwd_temp_mb'] >= 0
    assert row['fwd_bwd_gflop_per_s'] > 0 and 'fraction_of_peak' in row
  skipped = {(row['rows'], row['variant']): row['skipped'] for row in rows
             if 'skipped' in row}
  assert set(skipped) == {
      (kind, name) for kind in ('packed', 't5', 'capped')
      for name in ('chunked[cudnn]', 'linformer', 'ring')}
  assert skipped['t5', 'linformer'] == 'linformer takes no position bias'
  assert skipped['capped', 'linformer'] == (
      'linformer takes no cap on its logits')
  assert skipped['packed', 'linformer'] == (
      'linformer takes key padding masks only, not packed rows')
  assert skipped['packed', 'ring'] == (
      'ring needs a mesh with a sequence axis '
      '(tests/model/attention/variants/test_ring.py)')
  assert "kernel='cudnn' needs a GPU" in skipped['t5', 'chunked[cudnn]']
  with open(os.path.join(directory, 'results.md')) as f:
    table = f.read()
  # Each ratio is to xla on the same kind of rows.
  assert 'speedup_vs_xla' in table and '| packed | xla | 16 |' in table
  assert '| packed | chunked[pallas_gpu] | 16 |' in table
  assert '| t5 | chunked[pallas_gpu] | 16 |' in table
  with open(os.path.join(directory, 'results.csv')) as f:
    by_key = {(line['rows'], line['variant']): line
              for line in csv.DictReader(f)}
  for kind in ('packed', 't5', 'capped'):
    assert float(by_key[kind, 'chunked']['speedup_vs_xla']) == pytest.approx(
        measured[kind, 'xla']['fwd_bwd_s']
        / measured[kind, 'chunked']['fwd_bwd_s'], rel=1e-3)
  with open(os.path.join(directory, 'scaling.png'), 'rb') as f:
    assert f.read(4) == PNG


def test_bench_attention_skips_what_would_not_fit_or_take_too_long(tmp_path):
  common = dict(variants=['xla'], options={}, causal=False, batch=1, heads=2,
                head_dim=8, dtype='float32', reps=1)
  small, large = bench_attention.run(str(tmp_path), lengths=[16, 32],
                                     max_seconds=60.0, memory_limit_mb=1e-3,
                                     **common)
  assert 'more than the 0.0 GiB the device holds' in small['skipped']
  assert large['skipped'] == 'xla did not fit at length 16'
  first, second = bench_attention.run(str(tmp_path), lengths=[16, 32],
                                      max_seconds=0.0, **common)
  assert 'fwd_bwd_s' in first
  assert 'over --max_seconds=0' in second['skipped']


def test_bench_attention_records_a_compile_time_out_of_memory_and_goes_on(
    tmp_path, monkeypatch):
  """As XLA's autotuner on a GPU at 65536 tokens: the compile of the
  longer length runs out of memory; the next variant is still measured."""
  compile_ = bench_attention._compile

  def out_of_memory_from_32(program, args):
    if args[1].shape[1] >= 32:
      raise jax.errors.JaxRuntimeError(
          'RESOURCE_EXHAUSTED: Out of memory while trying to allocate '
          '137460809728 bytes (128.02GiB).')
    return compile_(program, args)

  monkeypatch.setattr(bench_attention, '_compile', out_of_memory_from_32)
  rows = bench_attention.run(
      str(tmp_path), variants=['xla', 'dense'], lengths=[16, 32, 64],
      options={}, causal=False, batch=1, heads=2, head_dim=8,
      dtype='float32', reps=1, max_seconds=60.0)
  by_key = {(row['variant'], row['length']): row for row in rows}
  assert 'fwd_bwd_s' in by_key['xla', 16] and 'fwd_bwd_s' in by_key[
      'dense', 16]
  assert by_key['xla', 32]['skipped'] == (
      'fwd ran out of device memory compiling (needed 128.0 GiB)')
  assert by_key['xla', 64]['skipped'] == 'xla did not fit at length 32'
  assert 'did_not_fit' not in by_key['xla', 32]


@pytest.mark.core
def test_attention_flops_count_the_two_matmuls():
  # q k^T and the weighted sum: 2 T^2 H multiply-adds per head.
  assert bench_attention.attention_flops(
      8, batch=1, heads=1, head_dim=4, causal=False, backward=False) == (
          2 * 2 * 8 * 8 * 4)
  assert bench_attention.attention_flops(
      8, batch=2, heads=3, head_dim=4, causal=True, backward=True) == (
          3.5 * 0.5 * 2 * 3 * 2 * 2 * 8 * 8 * 4)


def test_bench_attention_counts_a_variants_own_work(tmp_path):
  [row] = bench_attention.run(
      str(tmp_path), variants=['linear'], lengths=[16], options={},
      causal=True, batch=1, heads=2, head_dim=8, dtype='float32', reps=1,
      max_seconds=60.0)
  # The dense equivalent, and the work of its own gradient program.
  assert row['fwd_bwd_gflop_per_s'] > 0 and row['fraction_of_peak'] > 0
  assert row['own_gflop'] > 0 and row['own_fraction_of_peak'] > 0
  assert row['own_gflop_per_s'] == pytest.approx(
      row['own_gflop'] / row['fwd_bwd_s'])


def test_tile_flops_count_the_tiles_a_pallas_kernel_visits():
  """BigBird on the GPU's block-sparse kernel: its tiles are its blocks of
  16, 13 of them over 200 positions; on the JAX code, no tile count. The
  recording leaves the jitted variant on its kernel."""
  q = jnp.ones((2, 200, 3, 16))

  def recorded(kernel):
    fn, params = attention_cases.variant_fn(
        f'bigbird[{kernel}]', 'plain', 200,
        {'bigbird': dict(block=16, num_random_blocks=2)}, causal=True,
        heads=3, head_dim=16, q=q, mask=None, bias=None)
    args = (params, q, q, q, None, None)
    decisions = bench_attention.recorded_kernels(fn, args)
    assert [d.kernel for d in decisions] == [kernel]
    assert ('pallas_call' in str(jax.make_jaxpr(jax.jit(fn))(*args))) == (
        kernel != 'xla')
    return decisions

  pattern = bigbird_pattern(208, 16, 1, sparse.bigbird_random_blocks(
      13, 1, 2, seed=0), causal=True)
  tiles = pattern.reshape(13, 16, 13, 16).any(axis=(1, 3)).sum()
  assert 13 < tiles < 13 * 14 // 2
  assert bench_attention.tile_flops(
      recorded('pallas_gpu'), batch=2, heads=3, head_dim=16) == (
          3.5 * 4 * tiles * 16**2 * 16 * 2 * 3)
  assert bench_attention.tile_flops(
      recorded('xla'), batch=2, heads=3, head_dim=16) is None


def test_bench_attention_names_a_bad_argument(tmp_path):
  with pytest.raises(InputError, match="unknown attention 'flash'"):
    bench_attention.run(str(tmp_path), variants=['flash'], lengths=[16],
                        options={}, causal=True, batch=1, heads=2,
                        head_dim=8, dtype='float32', reps=1, max_seconds=1)
  with pytest.raises(InputError, match='--reps=0 must be at least 1'):
    bench_attention.run(str(tmp_path), variants=['xla'], lengths=[16],
                        options={}, causal=True, batch=1, heads=2,
                        head_dim=8, dtype='float32', reps=0, max_seconds=1)
  with pytest.raises(InputError, match="unknown kind 'ragged'"):
    bench_attention.run(str(tmp_path), variants=['xla'], lengths=[16],
                        options={}, causal=True, batch=1, heads=2,
                        head_dim=8, dtype='float32', reps=1, max_seconds=1,
                        rows=['ragged'])
  with pytest.raises(InputError, match='dense takes no kernel'):
    attention_cases.parse_variant('dense[cudnn]')
  with pytest.raises(InputError, match="no kernel 'flash'. The kernels: "):
    attention_cases.parse_variant('chunked[flash]')


@pytest.mark.slow
def test_bench_train_times_ours_and_the_stock_baseline(tmp_path, data_dir):
  config = lm_stdlib.get_config()
  config.data_dir = data_dir
  # At 16 rows, where the size has 8.
  ours, stock = bench_train.run(
      config, str(tmp_path), sizes=['tiny'], steps=1, warmup=1,
      attention='auto', dtype='float32', remat='none', batch_sizes=[16])
  assert (ours['model'], stock['model']) == ('attnlab', 'stock_flax')
  assert ours['batch'] == stock['batch'] == 16
  assert ours['attention'] == 'chunked'  # auto, on CPU.
  # The same architecture: the same parameters and model FLOPs.
  assert ours['params'] == stock['params']
  assert ours['model_gflop_per_token'] == stock['model_gflop_per_token']
  for row in (ours, stock):
    assert row['tokens_per_s'] > 0 and 0 < row['mfu'] < 1
  assert ours['speedup_vs_stock'] == pytest.approx(
      ours['tokens_per_s'] / stock['tokens_per_s'])
  assert ours['temp_mib'] > 0 and stock['temp_mib'] > 0
  # Timed in train_and_evaluate's loop too, on the config's dataset.
  assert ours['loop_efficiency'] == pytest.approx(
      ours['step_s'] / ours['loop_step_s'])
  assert ours['loop_step_s'] > 0
  [directory] = [entry.path for entry in os.scandir(tmp_path)]
  with open(os.path.join(directory, 'results.md')) as f:
    assert '| tiny | 16 | attnlab | chunked |' in f.read()
  with pytest.raises(InputError, match="unknown size 'huge'"):
    bench_train.run(lm_stdlib.get_config(), str(tmp_path), sizes=['huge'],
                    steps=1, warmup=1, attention='auto', dtype='float32',
                    remat='none')


def test_bench_compile_times_each_stage_of_a_start_at_each_depth(tmp_path):
  rows = bench_compile.run(lm_stdlib.get_config(), str(tmp_path),
                           size='tiny', layers=[1, 2], steps=1)
  # Both layouts have the same parameters.
  assert [(row['scan_layers'], row['layers'], row['params'])
          for row in rows] == [(False, 1, 17888), (False, 2, 26432),
                               (True, 1, 17888), (True, 2, 26432)]
  for row in rows:
    for key in ('build_s', 'trace_s', 'lower_s', 'compile_s', 'step_s'):
      assert row[key] > 0, key
  first, second, scanned_first, scanned_second = rows
  for row in (first, scanned_first):
    assert row['build_trace_vs_first'] == row['compile_vs_first'] == 1
  assert scanned_second['trace_compile_vs_first'] == pytest.approx(
      (scanned_second['trace_s'] + scanned_second['compile_s'])
      / (scanned_first['trace_s'] + scanned_first['compile_s']))
  assert first['step_vs_unscanned'] == 1
  assert scanned_second['step_vs_unscanned'] == pytest.approx(
      scanned_second['step_s'] / second['step_s'])
  [directory] = [entry.path for entry in os.scandir(tmp_path)]
  with open(os.path.join(directory, 'results.md')) as f:
    assert '| scan_layers | layers | params | build_s |' in f.read()
  with pytest.raises(InputError, match="unknown size 'huge'"):
    bench_compile.run(lm_stdlib.get_config(), str(tmp_path), size='huge',
                      layers=[1], steps=1)
  with pytest.raises(InputError, match="--layouts: rolled is not one of"):
    bench_compile.run(lm_stdlib.get_config(), str(tmp_path), size='tiny',
                      layers=[1], steps=1, layouts=('rolled',))


def test_bench_compile_refuses_a_depth_before_measuring_any(tmp_path,
                                                            monkeypatch):
  """Experts every 2 layers: a scanned group of 2 blocks, which 3 layers
  do not fill; refused before the unscanned rows are measured."""
  def measure(*args, **kwargs):
    raise AssertionError('measured')
  monkeypatch.setattr(bench_compile, 'measure', measure)
  config = lm_stdlib.get_config()
  config.model.moe.num_experts = 2
  with pytest.raises(InputError, match='^--layouts=scanned at --layers=3: '
                     'config.model.scan_layers repeats a group of 2 blocks'):
    bench_compile.run(config, str(tmp_path / 'out'), size='tiny',
                      layers=[2, 3], steps=1)
  assert not (tmp_path / 'out').exists()


def test_bench_input_times_the_pipeline_and_the_loop_and_splits_the_time(
    tmp_path, data_dir):
  """Two steps a call (its intervals rounded up to multiples): the
  pipeline's, the loop's and the profiled rows, the profile's stages
  adding up to its time."""
  config = lm_stdlib.get_config()
  config.update(data_dir=data_dir, seq_len=32, batch_size=8, log_every=5)
  config.model.max_len = 32
  assert bench_input.with_steps_per_call(config, 2).log_every == 6
  rows = bench_input.run(config, str(tmp_path), batches=20, warmup=2,
                         steps_per_call=[2])
  assert [row['row'] for row in rows] == ['pipeline', 'loop', 'profiled']
  for row in rows:
    assert row['batches_per_s'] > 0 and row['steps_per_call'] == 2
    assert row['tokens_per_s'] == pytest.approx(row['batches_per_s'] * 256)
  profiled = rows[2]
  stages = [f'{stage} ms' for stage in (*bench_input.STAGES, 'other')]
  assert all(profiled[stage] > 0 for stage in stages[:-1])
  assert sum(profiled[stage] for stage in stages) == pytest.approx(
      profiled['ms_per_batch'])
  with open(tmp_path / 'results.md') as f:
    assert '| profiled | 20 | 2 |' in f.read()


@pytest.mark.core
def test_a_benchmark_writes_the_committed_results_only_when_told(
    tmp_path, monkeypatch):
  """Without --out, a fresh folder of workdirs/ (ignored by git), never
  experiments/results/."""
  monkeypatch.chdir(tmp_path)
  committed = 'experiments/results/bench_compile'
  assert common.results_folder(committed, 'bench_compile') == committed
  chosen = common.results_folder(None, 'bench_compile')
  assert chosen.startswith('workdirs/bench_compile-')
  os.makedirs(chosen)
  assert common.results_folder(None, 'bench_compile') not in (chosen, None)


def test_a_benchmark_works_in_the_folder_out_names_and_says_so(
    tmp_path, monkeypatch, capsys):
  """One --out flag and one main for every benchmark: the work gets the
  folder (a fresh one of workdirs/ without --out), then a line names it."""
  monkeypatch.chdir(tmp_path)
  if 'out' not in flags.FLAGS:
    common.define_out_flag('bench_compile')
  assert 'experiments/results/bench_compile' in flags.FLAGS['out'].help
  # The benchmark's own flag, which its --help lists.
  assert flags.FLAGS.find_module_defining_flag('out') == __name__
  # As if --verbosity were given: run_main leaves the log level alone.
  monkeypatch.setattr(flags.FLAGS['verbosity'], 'present', 1)
  given = []
  for out in (str(tmp_path / 'results'), None):
    monkeypatch.setattr(flags.FLAGS['out'], 'value', out)
    common.results_main(['bench_compile'], 'bench_compile', given.append)
    assert capsys.readouterr().out == f'Results in {given[-1]}.\n'
  assert given[0] == str(tmp_path / 'results')
  assert given[1].startswith('workdirs/bench_compile-')


@pytest.mark.slow
def test_bench_seq2seq_times_the_rnn_and_the_transformer(tmp_path):
  config = algorithmic.get_config('task=reverse')
  config.model.update(d_model=16, num_heads=2, mlp_dim=32, num_layers=1)
  rows = bench_seq2seq.run(config, str(tmp_path), lengths=[8], batch=8,
                           steps=1, warmup=1)
  assert [(row['family'], row['length']) for row in rows] == [
      ('rnn_attention', 8), ('encoder_decoder', 8)]
  assert [row['sequential_steps'] for row in rows] == [16, 2]
  rnn, transformer = rows
  assert rnn['step_time_vs_transformer'] == pytest.approx(
      rnn['step_s'] / transformer['step_s'])
  [directory] = [entry.path for entry in os.scandir(tmp_path)]
  with open(os.path.join(directory, 'scaling.png'), 'rb') as f:
    assert f.read(4) == PNG
  with pytest.raises(InputError, match='--lengths=\\[0\\] must be positive'):
    bench_seq2seq.run(config, str(tmp_path), lengths=[0], batch=8, steps=1,
                      warmup=1)
