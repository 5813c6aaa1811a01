"""The general fused kernels (flex_gpu.py: Triton, flex_tpu.py: Mosaic),
interpreted on the CPU, against a float64 dense reference written here:
outputs and the gradients of q, k, v and of the score function's data,
for position biases, a cap, a learned temperature and block patterns, on
packed, padded and plain rows, inside one tile and across several, and
under x64; each lowered for its accelerator; and a model with T5's
learned bias trained on the kernel as on xla."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import attention_cases
from model import ModelConfig, attention, build, positions
from model.attention.core import patterns
from model.attention.kernels import flex, flex_gpu, flex_tpu, fused
from model.attention.variants import chunked, flex_variant, sparse
from tests.helpers import REPO, tolerance
from train.data import tasks
from train.program import steps

B, T, N, H = 2, 40, 4, 16  # T: no multiple of any tile, inside one.
# Across tiles: three of the GPU kernel's 64, two of the TPU's 128.
LONG = 150
SCALE = 0.25
KERNELS = {'gpu': flex_gpu.attention, 'tpu': flex_tpu.attention}


@dataclasses.dataclass(frozen=True)
class Dilated:
  """A window of `window` keys every `dilation`-th position, given only
  here, as a pattern (patterns.py's interface)."""

  window: int
  dilation: int
  tile = None
  by_offset = True
  in_tiles = True

  def allowed(self, q, k):
    offset = q - k
    return (abs(offset) < self.window * self.dilation) & (
        offset % self.dilation == 0)


# --- the score functions, and the same written out in float64 ---

def _temperature(s, data, q_index, k_index, head):
  del q_index, k_index, head
  return s * data['temperature']


def score_of(name, data, positions_BxT):
  """The PositionBias of score `name` on `data` (None for none)."""
  if name == 'alibi':
    bias = positions.alibi_bias(positions_BxT, positions_BxT, N)
    return dataclasses.replace(bias, data={**bias.data, **data})
  if name and name.startswith('t5'):
    layer = positions.T5Bias(N, 8, 16, bidirectional=name == 't5_both')
    return layer.apply({'params': {'embedding': data['table']}},
                       positions_BxT, positions_BxT)
  if name == 'temperature':
    return attention.PositionBias(data, _temperature,
                                  {'temperature': ('head',)})
  return None


def reference_logits(name, s_BxNxTxS, data, positions_BxT, logit_cap):
  """The logits of score `name`, in numpy-like float64 jax code."""
  s = logit_cap * jnp.tanh(s_BxNxTxS / logit_cap) if logit_cap else (
      s_BxNxTxS)
  relative = positions_BxT[:, None, None, :] - positions_BxT[:, None, :, None]
  if name == 'alibi':
    return s - data['slopes'][None, :, None, None] * jnp.abs(relative)
  if name and name.startswith('t5'):
    buckets = positions.t5_buckets(relative[:, 0], bidirectional=(
        name == 't5_both'), num_buckets=8, max_distance=16)
    return s + jnp.moveaxis(data['table'][buckets], -1, 1)
  if name == 'temperature':
    return s * data['temperature'][None, :, None, None]
  return s


def data_of(name, rng):
  """Float data of score `name`, away from the defaults."""
  if name == 'alibi':
    return {'slopes': jnp.asarray(positions.alibi_slopes(N)
                                  * (1 + rng.random(N)), jnp.float32)}
  if name and name.startswith('t5'):
    return {'table': jnp.asarray(rng.normal(size=(8, N)), jnp.float32)}
  if name == 'temperature':
    return {'temperature': jnp.asarray(0.5 + rng.random(N), jnp.float32)}
  return {}


# --- the rows ---

def packed(length):
  """(ids, positions) [B, length] of packed rows: runs of 3/8, 1/2 and
  1/8 of the row, ids 1, 2, 0 in example 0 and 3, 3, 4 in example 1."""
  runs = [3 * length // 8, length // 2]
  runs.append(length - sum(runs))
  return (np.repeat(np.array([[1, 2, 0], [3, 3, 4]]), runs, axis=1),
          np.concatenate([np.arange(n) for n in runs])[None].repeat(B, 0))


def valid_keys(length):
  """[B, length] bool: example 0 keeps a third of its keys from 7 on
  (causal queries before see none), example 1 none."""
  return np.stack([(np.arange(length) >= 7)
                   & (np.random.default_rng(3).random(length) < 0.3),
                   np.zeros(length, bool)])


def rows_of(rows, length=T):
  """(kernel keyword arguments, positions [B, T], allowed [B, 1, T, T])."""
  if rows == 'packed':
    ids, positions_BxT = packed(length)
    return (dict(q_ids_BxT=jnp.asarray(ids)), positions_BxT,
            (ids[:, :, None] == ids[:, None, :])[:, None])
  plain = np.broadcast_to(np.arange(length), (B, length))
  if rows == 'padded':
    valid = valid_keys(length)
    return (dict(q_ids_BxT=jnp.zeros((B, length), jnp.int32),
                 kv_ids_BxT=jnp.asarray(np.where(valid, 0, 1))), plain,
            np.broadcast_to(valid[:, None, None, :], (B, 1, length, length)))
  return {}, plain, np.ones((B, 1, length, length), bool)


def allowed_pairs(pattern, is_causal, rows, length=T):
  """[B, 1, T, T] bool: the pairs the rows, the pattern and causality
  allow, written out."""
  _, _, allowed = rows_of(rows, length)
  i, j = np.arange(length)[:, None], np.arange(length)[None, :]
  if pattern is not None:
    allowed = allowed & pattern.allowed(i, j)
  return allowed & (j <= i) if is_causal else allowed


def reference(q, k, v, data, *, score, pattern, is_causal, rows, logit_cap):
  """float64 dense attention [B, T, N, H] under the case."""
  length = q.shape[1]
  _, positions_BxT, _ = rows_of(rows, length)
  allowed = allowed_pairs(pattern, is_causal, rows, length)
  group = N // k.shape[2]
  k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
  s = jnp.einsum('btnh,bsnh->bnts', q, k) * SCALE
  logits = jnp.where(allowed, reference_logits(
      score, s, data, jnp.asarray(positions_BxT), logit_cap), -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  weights = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
  total = jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights / jnp.where(total > 0, total, 1.0)
  return jnp.einsum('bnts,bsnh->btnh', weights, v)


def loss_and_grads(fn, q, k, v, data):
  """(output, gradients of q, k, v and data) of sum(sin(output))."""
  def loss(q, k, v, data):
    out = fn(q, k, v, data)
    return jnp.sum(jnp.sin(out.astype(jnp.float32))), out
  (_, out), grads = jax.jit(jax.value_and_grad(
      loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, data)
  return (out, *grads)


RANDOM_BLOCKS = tuple(map(tuple, sparse.bigbird_random_blocks(
    3, 1, 1, seed=0).tolist()))
# name: (score, logit_cap, pattern, causal, rows, key/value heads, dtype,
# length, kernels). Each score function crosses tiles in one case at least.
CASES = {
    'alibi_causal_packed_gqa': (
        'alibi', 0.0, None, True, 'packed', 2, jnp.float32, LONG,
        'gpu tpu'),
    't5_bidirectional_padded_mqa': (
        't5_both', 0.0, None, False, 'padded', 1, jnp.float32, LONG,
        'gpu tpu'),
    't5_causal_mha_bfloat16': (
        't5_causal', 0.0, None, True, 'plain', 4, jnp.bfloat16, T,
        'gpu tpu'),
    'temperature_capped_packed_gqa': (
        'temperature', 2.0, None, False, 'packed', 2, jnp.float32, LONG,
        'gpu tpu'),
    'alibi_local_causal_padded_mqa': (
        'alibi', 0.0, patterns.Window(12), True, 'padded', 1, jnp.float32, T,
        'gpu tpu'),
    'strided_causal_gqa': (
        None, 0.0, patterns.Strided(8), True, 'plain', 2, jnp.float32, T,
        'gpu tpu'),
    'capped_fixed_padded_mha': (
        None, 3.0, patterns.Fixed(16, 3), False, 'padded', 4, jnp.float32, T,
        'gpu tpu'),
    # BigBird's blocks of 16 are the GPU kernel's tiles; a TPU's are 128.
    'bigbird_causal_packed_gqa': (
        None, 0.0, patterns.BigBird(16, 1, RANDOM_BLOCKS), True, 'packed',
        2, jnp.float32, T, 'gpu'),
    't5_dilated_causal_mha': (
        't5_causal', 0.0, Dilated(4, 3), True, 'plain', 4, jnp.float32, T,
        'gpu tpu'),
}


def check_case(kernel, name):
  """The kernel's outputs and gradients under case `name` equal the
  float64 reference's; queries that see no key come out 0."""
  (score, logit_cap, pattern, is_causal, rows, num_kv_heads, dtype, length,
   _) = CASES[name]
  keys = jax.random.split(jax.random.key(len(name)), 3)
  q = jax.random.normal(keys[0], (B, length, N, H), jnp.float32)
  k, v = (jax.random.normal(key, (B, length, num_kv_heads, H), jnp.float32)
          for key in keys[1:])
  data = data_of(score, np.random.default_rng(len(name)))
  kwargs, positions_BxT, _ = rows_of(rows, length)
  attend = KERNELS[kernel]
  ours = loss_and_grads(
      lambda q, k, v, data: attend(
          q, k, v, score=score_of(score, data, jnp.asarray(positions_BxT)),
          pattern=pattern, scale=SCALE, is_causal=is_causal,
          logit_cap=logit_cap, **kwargs),
      *(x.astype(dtype) for x in (q, k, v)), data)
  with jax.enable_x64(True):
    cast = lambda tree: jax.tree.map(
        lambda x: jnp.asarray(x, jnp.float64), tree)
    want = loss_and_grads(
        lambda q, k, v, data: reference(
            q, k, v, data, score=score, pattern=pattern,
            is_causal=is_causal, rows=rows, logit_cap=logit_cap),
        *cast((q.astype(dtype), k.astype(dtype), v.astype(dtype), data)))
    want = jax.tree.map(lambda x: np.asarray(x, np.float32), want)
  chex.assert_trees_all_close(
      jax.tree.map(lambda x: np.asarray(x, np.float32), ours), want,
      **(tolerance.BFLOAT16 if dtype == jnp.bfloat16 else tolerance.KERNEL))
  if rows == 'padded':
    blind = ~allowed_pairs(pattern, is_causal, rows, length)[:, 0].any(-1)
    assert blind.any()
    np.testing.assert_array_equal(np.asarray(ours[0], np.float32)[blind], 0)


@pytest.mark.parametrize('kernel,name', [
    (kernel, name) for name, case in CASES.items()
    for kernel in case[-1].split()])
def test_general_kernel_equals_the_float64_reference(kernel, name):
  check_case(kernel, name)


def test_the_general_kernel_under_x64_equals_the_float64_reference():
  """With jax_enable_x64 on, as float64 checks run, the TPU's kernel on
  float32 inputs (grouped heads, whose key head is an int32 division of
  the query head's) equals the float64 reference as it does without."""
  with jax.enable_x64(True):
    check_case('tpu', 'alibi_local_causal_padded_mqa')


def test_every_fused_kernel_traces_under_x64():
  """With jax_enable_x64 on, the backends' flash attention (Triton's;
  splash's under grouped heads) and their general kernels (a score
  function) trace forward and backward: no int32 program id of theirs
  meets an int64 divisor."""
  ids, positions_BxT = packed(T)
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
  k = jax.ShapeDtypeStruct((B, T, 2, H), jnp.float32)
  data = data_of('alibi', np.random.default_rng(0))
  with jax.enable_x64(True):
    for kernel in ('pallas_gpu', 'pallas_tpu'):
      for score in (None, 'alibi'):
        grads = jax.eval_shape(lambda q, k, v, data: loss_and_grads(
            lambda q, k, v, data: chunked.attend(
                q, k, v, score_of(score, data, jnp.asarray(positions_BxT)),
                attention.SegmentMask(jnp.asarray(ids, jnp.int32)),
                scale=SCALE, is_causal=True, kernel=kernel),
            q, k, v, data), q, k, k, data)
        assert grads[1].dtype == jnp.float32, (kernel, score)


@pytest.mark.parametrize('kernel,name', [
    (kernel, name) for name, case in CASES.items()
    for kernel in case[-1].split()])
def test_general_kernel_lowers_for_its_accelerator(monkeypatch, kernel,
                                                   name):
  """Exported for a GPU (Triton) or a TPU (Mosaic) from this CPU, not
  interpreted, with the gradient of the score's data: the forward, dq and
  dk/dv kernels lower to three calls."""
  (score, logit_cap, pattern, is_causal, rows, num_kv_heads, _, length,
   _) = CASES[name]
  platform, call = {'gpu': ('cuda', '__gpu$xla.gpu.triton'),
                    'tpu': ('tpu', 'tpu_custom_call')}[kernel]
  monkeypatch.setattr(jax, 'default_backend', lambda: kernel)
  kwargs, positions_BxT, _ = rows_of(rows, length)
  data = data_of(score, np.random.default_rng(0))

  def loss(q, k, v, data):
    out = KERNELS[kernel](
        q, k, v, score=score_of(score, data, jnp.asarray(positions_BxT)),
        pattern=pattern, scale=SCALE, is_causal=is_causal,
        logit_cap=logit_cap, **kwargs)
    return jnp.sum(out.astype(jnp.float32))

  shape = lambda heads: jax.ShapeDtypeStruct((B, length, heads, H),
                                             jnp.bfloat16)
  exported = jax.export.export(
      jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(call)])(
          shape(N), shape(num_kv_heads), shape(num_kv_heads), data)
  assert exported.mlir_module().count(f'@{call}(') == 3


def test_new_values_of_the_data_reuse_the_compiled_kernel():
  """The score function's data are inputs of the kernel, not constants
  traced into it: other values run the same compiled program."""
  traces = []

  def temperature(s, data, q_index, k_index, head):
    traces.append(head)
    return _temperature(s, data, q_index, k_index, head)

  @jax.jit
  def attend(q, k, v, data):
    return flex_gpu.attention(
        q, k, v, score=attention.PositionBias(
            data, temperature, {'temperature': ('head',)}), scale=SCALE,
        is_causal=True)

  q = jax.random.normal(jax.random.key(0), (1, 16, N, H))
  first = attend(q, q, q, {'temperature': jnp.ones(N)})
  seen = len(traces)
  second = attend(q, q, q, {'temperature': jnp.full(N, 2.0, jnp.float32)})
  assert seen and len(traces) == seen and attend._cache_size() == 1
  assert not np.allclose(first, second)


def test_t5_training_on_the_general_kernel_equals_it_on_xla():
  """Five AdamW steps of a decoder with T5's learned bias on the GPU's
  kernel (interpreted) end at xla's parameters, the bias table's too. No
  key bias: its gradient is rounding noise (a softmax ignores what every
  key adds alike), which Adam's steps would amplify."""
  def trained(kernel):
    config = ModelConfig(
        vocab_size=16, d_model=32, num_heads=2, num_layers=1, mlp_dim=32,
        max_len=16, position='t5_bias', relative_buckets=8,
        relative_max_distance=16, attention='chunked', use_bias=False,
        attention_options=(('kernel', kernel),))
    model = build(config)
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, 16, (2, 16)).astype(np.int32)
    batch = {'inputs': inputs, 'targets': np.roll(inputs, -1, axis=1),
             'positions': np.tile(np.arange(16), (2, 1)),
             'segment_ids': np.repeat([[1, 2]], 8, axis=1).repeat(2, 0),
             'weights': np.ones((2, 16), np.float32)}
    params = steps.init_params(model, tasks.LM, jax.random.key(0), 16)
    optimizer = optax.adamw(1e-2)
    state = steps.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                             opt_state=optimizer.init(params))
    step = jax.jit(lambda state: steps.train_step(
        state, batch, jax.random.key(0), model=model, task=tasks.LM,
        optimizer=optimizer, learning_rates={})[0])
    for _ in range(5):
      state = step(state)
    return params, state.params

  (start, fused), (_, xla) = trained('pallas_gpu'), trained('xla')
  chex.assert_trees_all_close(fused, xla, atol=1e-5, rtol=1e-5)
  table = lambda params: [x for path, x in jax.tree_util.tree_leaves_with_path(
      params) if 't5_bias' in jax.tree_util.keystr(path)]
  assert table(fused) and not np.allclose(table(fused), table(start))


# --- a variant by its functions: docs/attention.md's example ---


@pytest.fixture
def dilated(monkeypatch):
  """docs/attention.md's example run as written (in a copy of the
  registry): its pattern class, with 'dilated' registered."""
  monkeypatch.setattr(attention, '_REGISTRY', dict(attention._REGISTRY))
  with open(REPO / 'docs' / 'attention.md') as f:
    text = f.read()
  start = text.index('```python\n', text.index(
      '<!-- example: a variant by its functions')) + len('```python\n')
  scope = {}
  exec(text[start:text.index('```', start)], scope)  # pylint: disable=exec-used
  return scope['Dilated']


def test_a_variant_registered_by_its_functions_runs_on_every_kernel(
    dilated, monkeypatch):
  """The example's variant: its XLA code and both general kernels equal
  the float64 reference on packed rows (GQA), gradients of its learned
  temperature included; `auto` takes the kernels on a GPU and a TPU."""
  q, k, v = (jax.random.normal(key, (B, T, heads, H)) for key, heads in zip(
      jax.random.split(jax.random.key(7), 3), (N, 2, 2)))
  data = data_of('temperature', np.random.default_rng(7))
  options = dict(window=4, dilation=3, is_causal=True,
                 mask=attention.SegmentMask(jnp.asarray(packed(T)[0])),
                 scale=SCALE)
  with jax.enable_x64(True):
    want = loss_and_grads(
        lambda q, k, v, data: reference(
            q, k, v, data, score='temperature', pattern=dilated(4, 3),
            is_causal=True, rows='packed', logit_cap=0.0),
        *jax.tree.map(lambda x: jnp.asarray(x, jnp.float64),
                      (q, k, v, data)))
    want = jax.tree.map(lambda x: np.asarray(x, np.float32), want)
  for kernel in ('xla', 'pallas_gpu', 'pallas_tpu'):
    chex.assert_trees_all_close(loss_and_grads(
        lambda q, k, v, data: attention.get('dilated')(
            q, k, v, data=data, kernel=kernel, **options), q, k, v, data),
                                want, **tolerance.KERNEL)
  for backend in ('gpu', 'tpu'):
    monkeypatch.setattr(fused, 'device_description', lambda: (backend, None))
    with fused.recording() as decisions:
      attention.get('dilated')(*(x.astype(jnp.bfloat16) for x in (q, k, v)),
                               data=data, **options)
    assert [d.kernel for d in decisions] == [f'pallas_{backend}']


def test_a_variant_registered_by_its_functions_trains_and_is_benchmarked(
    dilated):
  """A model of the example's variant owns its temperatures and trains
  them; the benchmarks' rows run it on a named kernel."""
  config = ModelConfig(vocab_size=16, d_model=32, num_heads=2, num_layers=1,
                       mlp_dim=32, max_len=16, attention='dilated',
                       attention_options=(('window', 4), ('dilation', 2)))
  model = build(config)
  params = steps.init_params(model, tasks.LM, jax.random.key(0), 16)
  (temperature,) = [x for path, x in jax.tree_util.tree_leaves_with_path(
      params) if 'temperature' in jax.tree_util.keystr(path)]
  assert temperature.shape == (2,)
  inputs = jnp.asarray(np.random.default_rng(0).integers(1, 16, (2, 16)))
  grads = jax.grad(lambda params: jnp.sum(model.apply(
      {'params': params}, inputs, deterministic=True)[0]))(params)
  assert [x for path, x in jax.tree_util.tree_leaves_with_path(grads)
          if 'temperature' in jax.tree_util.keystr(path)][0].any()
  q = jax.random.normal(jax.random.key(1), (2, 32, 2, 16))
  mask = attention_cases.rows_mask('packed', 2, 32)
  outputs = []
  for name in ('dilated', 'dilated[pallas_gpu]'):
    fn, variables = attention_cases.variant_fn(
        name, 'packed', 32, {'dilated': {'window': 4}}, causal=True,
        heads=2, head_dim=16, q=q, mask=mask, bias=None)
    outputs.append(fn(variables, q, q, q, mask))
  chex.assert_trees_all_close(*outputs, **tolerance.KERNEL)


def test_a_pattern_that_cannot_find_blind_queries_leaves_splash_under_padding():
  """Under key padding, splash zeroes the queries that see no key by the
  pattern's `sees_keys`; a pattern without one (the dilated window) runs
  on the TPU's general kernel, which finds them itself."""
  q, k, v = (jax.random.normal(key, (B, T, N, H))
             for key in jax.random.split(jax.random.key(5), 3))
  pattern = Dilated(4, 3)
  ours = chunked.attend(q, k, v, None,
                        jnp.asarray(valid_keys(T))[:, None, None],
                        scale=SCALE, is_causal=False, kernel='pallas_tpu',
                        pattern=pattern)
  chex.assert_trees_all_close(ours, attention.scaled_dot_product_attention(
      q, k, v, mask=jnp.asarray(allowed_pairs(pattern, False, 'padded')),
      scale=SCALE), **tolerance.KERNEL)


@pytest.mark.parametrize('is_causal', [True, False])
def test_the_tpu_kernel_steps_over_every_tile_without_a_table(is_causal):
  """Without a pattern the TPU's kernel computes each step's tile (no
  table): over three tiles of 128, causal and not, under ALiBi on packed
  rows, as the float64 reference."""
  length = 300
  ids = np.repeat([[1, 2, 3]], [100, 150, 50], axis=1).repeat(B, 0)
  positions_BxT = jnp.asarray(np.concatenate(
      [np.arange(100), np.arange(150), np.arange(50)])[None].repeat(B, 0))
  q, k, v = (jax.random.normal(key, (B, length, N, H))
             for key in jax.random.split(jax.random.key(9), 3))
  data = data_of('alibi', np.random.default_rng(9))
  ours = loss_and_grads(lambda q, k, v, data: flex_tpu.attention(
      q, k, v, score=score_of('alibi', data, positions_BxT), scale=SCALE,
      is_causal=is_causal, q_ids_BxT=jnp.asarray(ids)), q, k, v, data)
  allowed = (ids[:, :, None] == ids[:, None, :])[:, None]
  if is_causal:
    allowed = allowed & np.tri(length, dtype=bool)
  with jax.enable_x64(True):
    def reference(q, k, v, data):
      s = jnp.einsum('btnh,bsnh->bnts', q, k) * SCALE
      logits = jnp.where(allowed, reference_logits(
          'alibi', s, data, positions_BxT, 0.0), -jnp.inf)
      return jnp.einsum('bnts,bsnh->btnh', jax.nn.softmax(logits), v)
    want = loss_and_grads(reference, *jax.tree.map(
        lambda x: jnp.asarray(x, jnp.float64), (q, k, v, data)))
    want = jax.tree.map(lambda x: np.asarray(x, np.float32), want)
  chex.assert_trees_all_close(ours, want, **tolerance.KERNEL)


def test_a_variant_of_a_score_function_alone_sees_every_pair(monkeypatch):
  """No pattern: every pair (under causality), on xla as on the kernel;
  an option it does not take is refused by name."""
  monkeypatch.setattr(attention, '_REGISTRY', dict(attention._REGISTRY))
  attention.register('tempered', flex_variant.variant(
      name='tempered', score=_temperature,
      learned={'temperature': flex_variant.Learned(('head',), 1.0)}))
  q = jax.random.normal(jax.random.key(3), (B, T, N, H))
  data = data_of('temperature', np.random.default_rng(3))
  tempered = attention.get('tempered')
  want = attention.scaled_dot_product_attention(
      q * data['temperature'][:, None], q, q, scale=SCALE, is_causal=True)
  for kernel in ('xla', 'pallas_gpu'):
    chex.assert_trees_all_close(
        tempered(q, q, q, data=data, scale=SCALE, is_causal=True,
                 kernel=kernel), want, **tolerance.KERNEL)
  with pytest.raises(TypeError, match=r"tempered takes no options \['window'\]"):
    tempered(q, q, q, data=data, window=3)


def test_the_backward_pass_sums_no_gradient_of_constant_data(monkeypatch):
  """ALiBi's slopes as models hold them, constants: the kernels' backward
  pass computes no gradient of them (a product and a reduction per tile
  saved); learned, it does."""
  plans = []
  masked = flex.Plan.masked
  monkeypatch.setattr(flex.Plan, 'masked', lambda plan, *args: (
      plans.append(plan.data_grads), masked(plan, *args))[1])
  q = jax.random.normal(jax.random.key(4), (1, 16, N, H))
  positions_1xT = jnp.arange(16)[None]
  alibi = positions.alibi_bias(positions_1xT, positions_1xT, N)
  attend = lambda q, slopes: flex_gpu.attention(
      q, q, q, score=dataclasses.replace(alibi, data={
          **alibi.data, 'slopes': slopes}), scale=SCALE, is_causal=True)
  # Traced, not run: the plans are the traces'.
  jax.eval_shape(jax.grad(lambda q: jnp.sum(attend(q, alibi.data['slopes']))),
                 q)
  assert plans[-1] is False  # The dk/dv kernel's trace, after dq's.
  plans.clear()
  jax.eval_shape(jax.grad(lambda q, slopes: jnp.sum(attend(q, slopes)),
                          argnums=(0, 1)), q, alibi.data['slopes'])
  assert set(plans) == {True}
