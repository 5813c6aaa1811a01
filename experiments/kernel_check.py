r"""Every fused attention kernel of the backend at hand, checked against the
dense core before anything is timed: a kernel that miscompiles would
otherwise be reported as fast (experiments/accelerator_report.py runs this
first and marks the rows of the kernels that failed).

  python -m experiments.kernel_check --out=DIR [--kernels=pallas_gpu] \
      [--cases=plain,alibi] [--dtypes=bfloat16]

The kernels (model/attention/kernels/fused.py) of the default backend: on a GPU
cuDNN's and the Pallas ones (flash attention, and the project's general
kernel flex_gpu.py), on a TPU splash attention and flex_tpu.py, on the CPU
both Pallas families interpreted. Each case calls attention variants with
the kernel named (`kernel=`), so nothing falls back: a case that the
kernel refuses (fused.refusal: cuDNN takes no float32, packed rows on
Hopper only) is skipped with the reason, recorded while tracing.

A case's program computes, in one jit, the output of its calls (summed,
where there are two: layers of other windows) and the gradients of
sum(sin(output)) with respect to q, k, v and the score function's float
data (ALiBi's slopes, T5's table) and the sinks, and the same of the dense
core
(attention.scaled_dot_product_attention) under the same bias, mask and cap,
and each pattern's pairs as a mask, on float32 copies of the same inputs at
full matmul precision. An error is the largest absolute difference from
that reference over the reference's largest magnitude; a case is ok where
every error is within its dtype's TOLERANCE, and failed where one is not
or where the case does not compile or run (the error is in its row).

Writes OUT/results.md and .csv (a row per kernel, case and dtype) and
OUT/failed_kernels.json ({kernel: [its failed cases]}, {} when every case
passed).
"""

from collections.abc import Sequence
import dataclasses
import json
import os
import sys
import time
from typing import Any

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import attention_cases, common
from model import attention, positions
from model.attention import core
from model.attention.kernels import fused
from train import cli
from train.base.errors import InputError

FLAGS = flags.FLAGS
FAILED_FILE = 'failed_kernels.json'
DTYPES = ('float32', 'bfloat16')
# The largest error each dtype tolerates, over the reference's largest
# magnitude: float32 allows for matmuls of float32 inputs in TF32 (a GPU's
# default) or bfloat16 passes (a TPU's), bfloat16 for the kernels'
# bfloat16 weights and outputs (interpreted on the CPU: under 1e-6 and
# 6e-3). A kernel that miscompiles errs by tenths.
TOLERANCE = {'float32': 1e-2, 'bfloat16': 5e-2}
B, N, K, H = 2, 4, 2, 64
T5_BUCKETS, T5_MAX_DISTANCE = 8, 64
# The fused kernels each backend runs; the CPU interprets both Pallas ones.
BACKEND_KERNELS = {**fused.AUTO_ORDER, 'cpu': ('pallas_gpu', 'pallas_tpu')}
PALLAS = ('pallas_gpu', 'pallas_tpu')
ERRORS = ('out', 'dq', 'dk', 'dv', 'd_data')
COLUMNS = ('kernel', 'case', 'dtype', 'length', *(f'{name}_error'
                                                  for name in ERRORS),
           'tolerance', 'ok', 'seconds', 'skipped', 'error')


@dataclasses.dataclass(frozen=True)
class Case:
  """Attention calls of one variant on one kind of rows."""

  # 'chunked', 'local', 'bigbird', or 'windows' (two local calls of other
  # windows, summed: layers of their own windows).
  variant: str
  # attention_cases.rows_mask's: 'plain', 'packed' (a SegmentMask) or
  # 'padded' (right padding, a key padding mask [B, 1, 1, S]).
  rows: str = 'plain'
  score: str | None = None  # 'alibi', 't5' (a core.PositionBias) or None.
  is_causal: bool = True
  logit_cap: float = 0.0  # chunked's; 0 for none.
  # A learned logit per head in the normaliser (core.sink_softmax).
  sinks: bool = False
  kernels: tuple[str, ...] = PALLAS  # The kernels it is a case of.


CASES = {
    # Each kernel's own path: cuDNN's, Pallas flash (GPU), splash (TPU);
    # on a GPU, a window and a pattern run the general kernel.
    'plain': Case('chunked', kernels=('cudnn', *PALLAS)),
    'padded': Case('chunked', rows='padded', is_causal=False,
                   kernels=('cudnn',)),
    'packed': Case('chunked', rows='packed', kernels=('cudnn', *PALLAS)),
    'window': Case('local', kernels=('cudnn', *PALLAS)),
    'bigbird': Case('bigbird'),
    # The general kernels (flex_gpu.py, flex_tpu.py): a score function or a
    # cap, beside patterns and masks.
    'alibi': Case('chunked', score='alibi'),
    't5_padded': Case('chunked', rows='padded', score='t5', is_causal=False),
    'logit_cap': Case('chunked', logit_cap=2.0),
    'bigbird_alibi': Case('bigbird', score='alibi'),
    'windows_alibi': Case('windows', score='alibi'),
    'documents_alibi': Case('chunked', rows='packed', score='alibi'),
    'sinks_packed': Case('chunked', rows='packed', sinks=True),
    'window_sinks': Case('local', sinks=True),
}


def length_of(kernel: str, backend: str) -> int:
  """The length of a kernel's cases: four BigBird blocks of its tile (128
  on a TPU's kernel; 64 on a GPU's, 16 interpreted on the CPU)."""
  if kernel == 'pallas_tpu':
    return 512
  return 64 if backend == 'cpu' else 256


def calls(variant: str, length: int) -> list[tuple[str, dict]]:
  """The attention calls (variant, options) of a Case's `variant`."""
  if variant == 'local':
    return [('local', {'window': length // 4})]
  if variant == 'windows':
    return [('local', {'window': length // 8}),
            ('local', {'window': length // 2})]
  if variant == 'bigbird':  # Four blocks: (1, 3) and (3, 1) left out.
    return [('bigbird', {'block': length // 4, 'num_global_blocks': 1,
                         'num_random_blocks': 0})]
  return [('chunked', {})]


def case_data(case: Case) -> dict[str, Any]:
  """The case's float data, which are differentiated: {'score': its score
  function's, 'sinks': [N] where it has sinks}."""
  score = {}
  if case.score == 'alibi':
    score = {'slopes': jnp.asarray(positions.alibi_slopes(N))}
  elif case.score == 't5':
    score = {'table': jnp.asarray(np.random.default_rng(0).normal(
        size=(T5_BUCKETS, N)), jnp.float32)}
  sinks = {'sinks': jnp.linspace(-2.0, 2.0, N)} if case.sinks else {}
  return {'score': score, **sinks}


def bias_and_mask(case: Case, data: dict, length: int):
  """(the case's score function on `data` (case_data's 'score'), or None;
  its rows' mask)."""
  positions_BxT = jnp.broadcast_to(jnp.arange(length), (B, length))
  bias = None
  if case.score == 'alibi':
    bias = positions.alibi_bias(positions_BxT, positions_BxT, N)
    bias = dataclasses.replace(bias, data={**bias.data, **data})
  elif case.score == 't5':
    layer = positions.T5Bias(N, T5_BUCKETS, T5_MAX_DISTANCE,
                             bidirectional=not case.is_causal)
    bias = layer.apply({'params': {'embedding': data['table']}},
                       positions_BxT, positions_BxT)
  return bias, attention_cases.rows_mask(case.rows, B, length)


def attend_by(case: Case, kernel: str, length: int):
  """attend(q, k, v, data): the case's calls, summed, on `kernel`."""
  cap = {'logit_cap': case.logit_cap} if case.logit_cap else {}

  def attend(q, k, v, data):
    bias, mask = bias_and_mask(case, data['score'], length)
    return sum(attention.get(variant)(q, k, v, bias, mask,
                                      is_causal=case.is_causal,
                                      kernel=kernel, sinks=data.get('sinks'),
                                      **options, **cap)
               for variant, options in calls(case.variant, length))
  return attend


def reference_by(case: Case, length: int, seen: list):
  """attend(q, k, v, data): dense under each call's pattern (`seen`, a
  pattern or None per call, as a core.PatternMask beside the rows' mask),
  summed."""
  def attend(q, k, v, data):
    bias, mask = bias_and_mask(case, data['score'], length)
    return sum(attention.scaled_dot_product_attention(
        q, k, v, bias, mask if pattern is None else core.PatternMask(
            mask, pattern), is_causal=case.is_causal,
        logit_cap=case.logit_cap, sinks=data.get('sinks'))
               for pattern in seen)
  return attend


def loss_and_grads(attend, q, k, v, data):
  """(output, gradients of q, k, v and data) of sum(sin(output))."""
  def loss(q, k, v, data):
    out = attend(q, k, v, data)
    return jnp.sum(jnp.sin(out.astype(jnp.float32))), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                       has_aux=True)(q, k, v, data)
  return (out, *grads)


def relative_error(got, want) -> jax.Array | None:
  """max |got - want| / max |want| over the leaves of two trees; None
  where there are none."""
  flat = lambda tree: [jnp.ravel(x).astype(jnp.float32)
                       for x in jax.tree.leaves(tree)]
  got, want = flat(got), flat(want)
  if not want:
    return None
  got, want = jnp.concatenate(got), jnp.concatenate(want)
  return jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)),
                                                    1e-30)


def errors(ours, reference) -> dict[str, jax.Array]:
  """{'out_error', 'dq_error', ...: relative_error} of two loss_and_grads."""
  found = {f'{name}_error': relative_error(got, want)
           for name, got, want in zip(ERRORS, ours, reference)}
  return {name: error for name, error in found.items() if error is not None}


def recorded(attend, *args) -> list[fused.Decision]:
  """The kernel choices of attend(*args), from a trace of its own."""
  with fused.recording() as decisions:
    jax.eval_shape(lambda *args: attend(*args), *args)
  return decisions


def case_errors(case: Case, kernel: str, length: int, dtype: str
                ) -> dict[str, float] | str:
  """errors() of `case` on `kernel`, or why the kernel refuses it."""
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, length, N, H), dtype)
  k, v = (jax.random.normal(key, (B, length, K, H), dtype)
          for key in keys[1:])
  data = case_data(case)
  attend = attend_by(case, kernel, length)
  decisions = recorded(attend, q, k, v, data)
  refused = [d for d in decisions if d.kernel != kernel]
  if refused:
    return f'{refused[0].refusal} ({refused[0].case.describe()})'
  reference = reference_by(case, length, [d.case.seen for d in decisions])

  @jax.jit
  def compare(q, k, v, data):
    ours = loss_and_grads(attend, q, k, v, data)
    with jax.default_matmul_precision('highest'):
      want = loss_and_grads(reference, *(x.astype(jnp.float32)
                                         for x in (q, k, v)), data)
    return errors(ours, want)

  return {name: float(error)
          for name, error in jax.device_get(compare(q, k, v, data)).items()}


def check_case(name: str, kernel: str, dtype: str, backend: str) -> dict:
  """One row: case `name` on `kernel` in `dtype`, or why it is skipped."""
  length = length_of(kernel, backend)
  row = {'kernel': kernel, 'case': name, 'dtype': dtype, 'length': length}
  start = time.perf_counter()
  try:
    found = case_errors(CASES[name], kernel, length, dtype)
  # Whatever stops a kernel compiling or running is its failure.
  except Exception as error:  # pylint: disable=broad-exception-caught
    message = (str(error).strip().splitlines() or [''])[0][:300]
    return row | {'ok': False, 'error': f'{type(error).__name__}: {message}'}
  if isinstance(found, str):
    return row | {'skipped': found}
  tolerance = TOLERANCE[dtype]
  # A NaN fails: it compares False.
  return row | found | {
      'tolerance': tolerance, 'seconds': time.perf_counter() - start,
      'ok': all(error <= tolerance for error in found.values())}


def check(backend: str, *, kernels: Sequence[str] | None = None,
          cases: Sequence[str] = tuple(CASES),
          dtypes: Sequence[str] = DTYPES) -> list[dict]:
  """A row per kernel of `backend` (or `kernels`), case of `cases` that
  the kernel has, and dtype; each printed as a JSON line as it ends (a run
  killed midway still says what it found)."""
  rows = []
  for kernel in kernels or BACKEND_KERNELS.get(backend, ()):
    for name in cases:
      if kernel in CASES[name].kernels:
        for dtype in dtypes:
          rows.append(check_case(name, kernel, dtype, backend))
          print(json.dumps(rows[-1]), flush=True)
  return rows


def failed_kernels(rows: list[dict]) -> dict[str, list[str]]:
  """{kernel: ['case dtype', ...]} of the rows that are not ok."""
  failed = {}
  for row in rows:
    if row.get('ok') is False:
      failed.setdefault(row['kernel'], []).append(
          f'{row["case"]} {row["dtype"]}')
  return failed


def read_failed(directory: str) -> dict[str, list[str]] | None:
  """failed_kernels as a run wrote it in `directory`; None if it wrote
  none (it did not end)."""
  return common.load_json(os.path.join(directory, FAILED_FILE))


def run(out: str, *, kernels: Sequence[str] | None = None,
        cases: Sequence[str] = tuple(CASES),
        dtypes: Sequence[str] = DTYPES, command: str = '') -> list[dict]:
  """Checks the default backend's kernels (or `kernels`) on `cases`
  in `dtypes`; writes the results to `out`."""
  backend = jax.default_backend()
  for flag, given, known in (
      ('--kernels', kernels or (), BACKEND_KERNELS.get(backend, ())),
      ('--cases', cases, CASES), ('--dtypes', dtypes, DTYPES)):
    unknown = [name for name in given if name not in known]
    if unknown:
      raise InputError(f'{flag}={",".join(given)}: no {", ".join(unknown)} '
                       f'on {backend}; the choices: {", ".join(known)}.')
  os.makedirs(out, exist_ok=True)
  start = time.perf_counter()
  rows = check(backend, kernels=kernels, cases=cases, dtypes=dtypes)
  failed = failed_kernels(rows)
  preamble = (
      '# Fused kernels against dense attention\n\n'
      + (f'Command: `{command}`\n\n' if command else '')
      + f'Machine: {common.machine_description()}.\n\n'
      f'B={B}, N={N}, K={K}, H={H}. Errors: the largest absolute '
      'difference from the dense core (float32, full matmul precision, '
      'the same bias, mask and cap, a pattern as a mask) over the '
      "reference's largest magnitude, of the output and the gradients of "
      "sum(sin(output)) with respect to q, k, v and the score's float data;"
      ' seconds: tracing, compiling and running both; error: what stopped '
      'a case compiling or running (a failure). '
      + ('Failed: ' + '; '.join(f'{kernel} ({", ".join(which)})'
                                for kernel, which in failed.items())
         if failed else 'Every case checked passed.')
      + f' The check took {time.perf_counter() - start:.0f} s.\n\n')
  print(common.write_table(rows, COLUMNS, os.path.join(out, 'results'),
                           preamble))
  common.save_json(os.path.join(out, FAILED_FILE), failed)
  return rows


def main(argv: list[str]) -> None:
  common.results_main(argv, 'kernel_check', lambda out: run(
      out, kernels=FLAGS.kernels or None, cases=FLAGS.cases or tuple(CASES),
      dtypes=FLAGS.dtypes or DTYPES,
      command='python -m experiments.kernel_check '
      + ' '.join(sys.argv[1:])))


def _define_flags() -> None:
  """The command line, defined only when this runs as a script."""
  common.define_out_flag('kernel_check')
  flags.DEFINE_list('kernels', [], "The kernels to check; empty: the "
                    "backend's (on the CPU both Pallas ones, interpreted).")
  flags.DEFINE_list('cases', [], f'The cases to check, of {", ".join(CASES)}'
                    '; empty: all.')
  flags.DEFINE_list('dtypes', [], f'Of {", ".join(DTYPES)}; empty: both.')


if __name__ == '__main__':
  cli.run(main, _define_flags)
