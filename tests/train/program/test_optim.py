"""The optimizers and learning-rate schedules (train/program/optim.py):
each schedule's course, and Muon's update against an SVD in float64."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import lm_stdlib
from model.matrices import Matrix, hidden_matrices, is_entry
from model.weight_decay import decay_mask
from tests.helpers.declared_params import boxed_params, small
from train.base.train_config import TrainConfig
from train.program import muon, optim


def _config(**overrides):
  return TrainConfig(**overrides)


@pytest.mark.core
def test_cosine_schedule_warms_up_then_decays_to_the_final_fraction():
  schedule = optim.learning_rate_schedule(_config(
      learning_rate=1.0, warmup_steps=10, num_train_steps=110,
      schedule='cosine', final_learning_rate_fraction=0.1))
  np.testing.assert_allclose([schedule(0), schedule(5), schedule(10)],
                             [0.0, 0.5, 1.0], atol=1e-6)
  np.testing.assert_allclose(schedule(60), 0.1 + 0.9 * 0.5, atol=1e-6)
  np.testing.assert_allclose(schedule(110), 0.1, atol=1e-6)


def test_rsqrt_schedule_is_inverse_square_root_after_warmup():
  schedule = optim.learning_rate_schedule(_config(
      learning_rate=2.0, warmup_steps=100, num_train_steps=10_000,
      schedule='rsqrt'))
  np.testing.assert_allclose(schedule(100), 2.0, rtol=1e-6)
  np.testing.assert_allclose(schedule(400), 2.0 * np.sqrt(100 / 400),
                             rtol=1e-6)


def test_linear_and_constant_schedules():
  config = _config(learning_rate=1.0, warmup_steps=0, num_train_steps=100,
                   final_learning_rate_fraction=0.0)
  config = dataclasses.replace(config, schedule='linear')
  np.testing.assert_allclose(optim.learning_rate_schedule(config)(50), 0.5)
  config = dataclasses.replace(config, schedule='constant')
  np.testing.assert_allclose(optim.learning_rate_schedule(config)(50), 1.0)


@pytest.mark.core
def test_wsd_schedule_holds_the_peak_then_decays_over_the_last_fraction():
  schedule = optim.learning_rate_schedule(_config(
      learning_rate=1.0, warmup_steps=10, num_train_steps=110,
      schedule='wsd', decay_fraction=0.2, final_learning_rate_fraction=0.0))
  np.testing.assert_allclose(
      [schedule(s) for s in (5, 10, 50, 88, 99, 110)],
      [0.5, 1.0, 1.0, 1.0, 0.5, 0.0], atol=1e-6)


def _stdlib_wsd(num_train_steps: int, **overrides):
  """The default experiment's wsd schedule (50 warmup steps, the last 0.2
  of the run decaying to 0.1 of the peak), over a run of that length."""
  config = lm_stdlib.get_config()
  config.update(num_train_steps=num_train_steps, **overrides)
  config = TrainConfig.from_config(config)
  return config, optim.learning_rate_schedule(config)


@pytest.mark.parametrize('num_train_steps, warmup_steps',
                         [(20, 50), (60, 50), (100, 90)])
def test_wsd_too_short_for_its_warmup_and_cooldown_still_ends_at_the_final_rate(
    num_train_steps, warmup_steps):
  config, schedule = _stdlib_wsd(num_train_steps, warmup_steps=warmup_steps)
  assert warmup_steps + optim.wsd_cooldown_steps(config) > num_train_steps
  rates = np.asarray(schedule(jnp.arange(num_train_steps + 1)))
  peak = config.learning_rate
  assert rates[-1] == np.float32(peak * config.final_learning_rate_fraction)
  top = int(rates.argmax())
  assert (np.diff(rates[:top + 1]) >= 0).all()
  assert (np.diff(rates[top:]) <= 0).all()  # Monotone after the warmup.
  ramp = peak * np.arange(num_train_steps + 1) / warmup_steps
  assert (rates <= ramp + 1e-6 * peak).all()  # Never above the warmup's.


@pytest.mark.parametrize('learning_rate', [3.3e-3, 0.03, 0.7])
@pytest.mark.parametrize('num_train_steps, warmup_steps, decay_fraction',
                         [(70, 50, 0.2), (1000, 50, 0.2), (20, 1, 0.1)])
def test_wsd_with_room_for_warmup_and_cooldown_is_the_trapezoid_bitwise(
    learning_rate, num_train_steps, warmup_steps, decay_fraction):
  """Against the trapezoid as optax composes it: warmup, then the peak
  held, then the linear cooldown (whose first value may round above the
  peak)."""
  config, schedule = _stdlib_wsd(
      num_train_steps, learning_rate=learning_rate,
      warmup_steps=warmup_steps, decay_fraction=decay_fraction)
  cooldown = round(decay_fraction * num_train_steps)
  trapezoid = optax.join_schedules(
      [optax.linear_schedule(0.0, learning_rate, warmup_steps),
       optax.join_schedules(
           [optax.constant_schedule(learning_rate),
            optax.linear_schedule(
                learning_rate,
                learning_rate * config.final_learning_rate_fraction,
                cooldown)],
           [num_train_steps - warmup_steps - cooldown])], [warmup_steps])
  counts = jnp.arange(num_train_steps + 2)
  np.testing.assert_array_equal(schedule(counts), trapezoid(counts))


# optax's quintic Newton-Schulz coefficients (Jordan et al. 2024).
_QUINTIC = (3.4445, -4.775, 2.0315)


class _Reading:
  """A config that records the keys read of it."""

  def __init__(self, config: TrainConfig):
    self.config, self.read = config, set()

  def __getattr__(self, key: str):
    self.read.add(key)
    return getattr(self.config, key)


def test_each_optimizer_declares_the_keys_it_reads_that_others_do_not():
  """Optimizer.reads is what building it reads beyond what every
  optimizer reads (the schedule, weight decay, clipping): the keys that a
  config of another optimizer is warned of setting."""
  boxed = boxed_params(small(num_layers=1))
  read = {}
  for name in optim.OPTIMIZERS:
    config = _Reading(TrainConfig(optimizer=name))
    optim.make_optimizer(config, boxed)
    read[name] = config.read
  shared = set.intersection(*read.values())
  assert {name: read[name] - shared for name in read} == {
      name: set(optimizer.reads)
      for name, optimizer in optim.OPTIMIZERS.items()}


def _orthogonalised(momentum, matrix: Matrix):
  """Muon's direction for a parameter's (Nesterov) momentum, in float64:
  each matrix M = U S V^T (the parameter's axes flattened as `matrix`
  says, one per stacked index) becomes U p(S / |M|_F) V^T, p the quintic
  applied five times, times sqrt(max(1, outputs / inputs)). Returns (the
  direction, S / |M|_F, p's values)."""
  momentum = np.asarray(momentum, np.float64)
  stacks = [axis for axis in range(momentum.ndim)
            if axis not in matrix.reduction_axis + matrix.output_axis]
  order = stacks + list(matrix.reduction_axis) + list(matrix.output_axis)
  inputs = math.prod(momentum.shape[a] for a in matrix.reduction_axis)
  outputs = math.prod(momentum.shape[a] for a in matrix.output_axis)
  matrices = momentum.transpose(order).reshape(-1, inputs, outputs)
  u, s, vt = np.linalg.svd(matrices, full_matrices=False)
  normalised = s = s / np.linalg.norm(matrices, axis=(1, 2))[:, None]
  a, b, c = _QUINTIC
  for _ in range(5):
    s = a * s + b * s ** 3 + c * s ** 5
  direction = max(1.0, outputs / inputs) ** 0.5 * (u * s[:, None, :]) @ vt
  unflat = [momentum.shape[axis] for axis in order]
  return (direction.reshape(unflat).transpose(np.argsort(order)), normalised,
          s)


@pytest.mark.core
def test_muon_orthogonalises_each_matrix_and_adamw_the_rest_elementwise():
  """Three steps on a warmup: attention's per-head projections as
  [D, H * K] and [H * K, D], the MLP's as they are, each expert's alone,
  each along its Nesterov momentum (optax's bias-corrected form) at
  muon_learning_rate on the schedule; every other parameter by Adam at
  learning_rate. References in float64 from the definitions."""
  boxed = boxed_params(small(num_layers=2, mlp_activation='swiglu', moe=dict(
      num_experts=2, top_k=1, every_n_layers=2)))
  params = nn.meta.unbox(boxed)
  leaves, structure = jax.tree.flatten(params)
  config = TrainConfig(optimizer='muon', learning_rate=0.01,
                       muon_learning_rate=0.1, muon_momentum=0.9,
                       warmup_steps=4, schedule='constant', weight_decay=0.0,
                       grad_clip_norm=0.0)
  optimizer, _ = optim.make_optimizer(config, boxed)
  params = jax.tree.map(jnp.ones_like, params)
  state = optimizer.init(params)
  update = jax.jit(optimizer.update)
  matrices = jax.tree.leaves(hidden_matrices(boxed), is_leaf=is_entry)
  beta, (b1, b2) = config.muon_momentum, (config.adam_b1, config.adam_b2)
  first = [np.zeros(leaf.shape) for leaf in leaves]  # Momenta, Adam's m.
  second = [np.zeros(leaf.shape) for leaf in leaves]  # Adam's v.
  kinds = set()
  for step in range(1, 4):
    keys = jax.random.split(jax.random.key(step), len(leaves))
    gradients = [jax.random.normal(key, leaf.shape)
                 for key, leaf in zip(keys, leaves)]
    updates, state = update(structure.unflatten(gradients), state, params)
    fraction = (step - 1) / config.warmup_steps  # The schedule at its count.
    for index, (path, got) in enumerate(
        jax.tree_util.tree_leaves_with_path(updates)):
      name, matrix = jax.tree_util.keystr(path), matrices[index]
      g = np.asarray(gradients[index], np.float64)
      if matrix is None:
        first[index] = b1 * first[index] + (1 - b1) * g
        second[index] = b2 * second[index] + (1 - b2) * g ** 2
        want = -config.learning_rate * fraction * (
            first[index] / (1 - b1 ** step)) / (
                np.sqrt(second[index] / (1 - b2 ** step)) + config.adam_eps)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9,
                                   err_msg=f'{name} at step {step}')
        continue
      kinds.add(matrix)
      first[index] = beta * first[index] + (1 - beta) * g
      nesterov = (beta * first[index] / (1 - beta ** (step + 1))
                  + (1 - beta) * g / (1 - beta ** step))
      direction, before, after = _orthogonalised(nesterov, matrix)
      np.testing.assert_allclose(
          got, -config.muon_learning_rate * fraction * direction,
          rtol=2e-4, atol=1e-7, err_msg=f'{name} at step {step}')
      # The quintic trades exactness for speed: U V^T's singular values
      # of one come out between about 0.68 and 1.2 (five steps lift no
      # more than about 3.4^5 times: those far below |M|_F stay small).
      assert np.abs(after[before > 0.02] - 1).max() < 0.35, name
  assert kinds == {Matrix((0,), (1, 2)), Matrix((0, 1), (2,)),
                   Matrix((0,), (1,)), Matrix((1,), (2,))}


def test_muon_orthogonalises_the_matrices_of_one_shape_in_one_batch():
  """A matmul count independent of depth: each Newton-Schulz step is three
  matmuls per shape of matrix (turned to no more rows than columns), not
  per matrix, so that a GPU runs a few batched kernels, not hundreds."""
  config = TrainConfig(optimizer='muon', grad_clip_norm=0.0)
  counts = []
  for layers in (1, 3):
    boxed = boxed_params(small(num_layers=layers))
    params = nn.meta.unbox(boxed)
    optimizer, _ = optim.make_optimizer(config, boxed)
    hlo = jax.jit(optimizer.update).lower(
        params, optimizer.init(params), params).as_text()
    shapes = {tuple(sorted(m.sizes(leaf.shape)))
              for leaf, m in zip(jax.tree.leaves(params), jax.tree.leaves(
                  hidden_matrices(boxed), is_leaf=is_entry)) if m}
    counts.append(hlo.count('dot_general'))
    assert counts[-1] == 3 * muon.NS_STEPS * len(shapes), layers
  assert counts[0] == counts[1]


@pytest.mark.parametrize('optimizer', ['adamw', 'muon'])
def test_attention_alone_trains_its_own_updates_unchanged(optimizer):
  """config.trained_params='attention': the self-attention layers' updates
  are those of training everything with the other gradients zero (the
  clipping sees theirs alone; to rounding); every other parameter, weight
  decay included, does not move at all."""
  boxed = boxed_params(small(num_layers=2))
  params = jax.tree.map(jnp.ones_like, nn.meta.unbox(boxed))
  config = dict(optimizer=optimizer, learning_rate=0.01, weight_decay=0.1,
                warmup_steps=1, schedule='constant', grad_clip_norm=0.5)
  inside = lambda path: "['self_attention']" in jax.tree_util.keystr(path)
  keys = jax.random.split(jax.random.key(0), len(jax.tree.leaves(params)))
  gradients = jax.tree.unflatten(jax.tree.structure(params), [
      jax.random.normal(key, leaf.shape)
      for key, leaf in zip(keys, jax.tree.leaves(params))])
  alone, _ = optim.make_optimizer(
      _config(trained_params='attention', **config), boxed)
  every, _ = optim.make_optimizer(_config(**config), boxed)
  masked = jax.tree_util.tree_map_with_path(
      lambda path, g: g if inside(path) else jnp.zeros_like(g), gradients)

  def second_update(optimizer, gradients):  # The first is warmup's zero.
    state = optimizer.init(params)
    _, state = optimizer.update(gradients, state, params)
    return optimizer.update(gradients, state, params)[0]

  got = second_update(alone, gradients)
  want = second_update(every, masked)
  for path, update in jax.tree_util.tree_leaves_with_path(got):
    if inside(path):
      np.testing.assert_allclose(
          update, dict(jax.tree_util.tree_leaves_with_path(want))[path],
          rtol=1e-6, atol=1e-7)
    else:
      assert not np.any(update), jax.tree_util.keystr(path)
  assert any(np.any(u) for p, u in jax.tree_util.tree_leaves_with_path(got)
             if inside(p))


def _leaf_updates(config: TrainConfig, boxed, params, gradients):
  """The first update of `config`'s optimizer, leaf by leaf."""
  optimizer, _ = optim.make_optimizer(config, boxed)
  updates, _ = optimizer.update(gradients, optimizer.init(params), params)
  return jax.tree.leaves(updates)


@pytest.mark.core
@pytest.mark.parametrize('optimizer', ['adamw', 'muon'])
def test_cautious_weight_decay_decays_where_update_and_weight_agree(
    optimizer):
  """update = -rate * (direction + weight_decay * w * [direction * w >= 0])
  on the decayed weights; the direction is AdamW's (here the sign of the
  gradient, on a first step) or, for Muon's matrices, read off the plain
  decay's update; biases and scales are never decayed."""
  boxed = boxed_params(small(num_layers=1))
  params = nn.meta.unbox(boxed)
  leaves, structure = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(0), 2 * len(leaves))
  params = structure.unflatten([jax.random.normal(key, leaf.shape)
                                for key, leaf in zip(keys, leaves)])
  gradients = structure.unflatten([
      jax.random.normal(key, leaf.shape)
      for key, leaf in zip(keys[len(leaves):], leaves)])
  base = dict(optimizer=optimizer, learning_rate=0.01, muon_learning_rate=0.1,
              weight_decay=0.5, warmup_steps=0, schedule='constant',
              grad_clip_norm=0.0)
  plain = _leaf_updates(_config(**base), boxed, params, gradients)
  cautious = _leaf_updates(_config(cautious_weight_decay=True, **base), boxed,
                           params, gradients)
  decayed = jax.tree.leaves(decay_mask(boxed))
  matrices = jax.tree.leaves(hidden_matrices(boxed), is_leaf=is_entry)
  agreeing = []
  for index, (w, g) in enumerate(zip(jax.tree.leaves(params),
                                     jax.tree.leaves(gradients))):
    w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
    muon_matrix = optimizer == 'muon' and matrices[index] is not None
    rate = base['muon_learning_rate' if muon_matrix else 'learning_rate']
    decay = base['weight_decay'] if decayed[index] else 0.0
    direction = (-np.asarray(plain[index], np.float64) / rate - decay * w
                 if muon_matrix else g / (np.abs(g) + 1e-9))
    agree = direction * w >= 0
    want = -rate * (direction + decay * w * agree)
    np.testing.assert_allclose(cautious[index], want, rtol=1e-5, atol=1e-7)
    if decay:
      agreeing.append(agree.mean())
  assert 0.3 < np.mean(agreeing) < 0.7  # Both cases are exercised.


@pytest.mark.core
def test_normuon_divides_each_neurons_update_by_its_running_rms():
  """muon.normalise_neurons against its formula, over three steps: a
  matrix's direction O [inputs, outputs] (an expert stack's each alone)
  becomes O / sqrt(nu) per output, nu <- beta nu + (1 - beta) mean_inputs
  O^2, scaled back to |O|_F."""
  matrices = {'stack': Matrix((1,), (2,)), 'heads': Matrix((0,), (1, 2))}
  shapes = {'stack': (2, 6, 4), 'heads': (6, 2, 3)}
  transform = muon.normalise_neurons(matrices, beta=0.9, eps=0.0)
  state = transform.init({k: jnp.zeros(s) for k, s in shapes.items()})
  nu = {'stack': np.zeros((2, 4)), 'heads': np.zeros((1, 6))}
  for step in range(3):
    updates = {k: jax.random.normal(jax.random.key(10 * step + i), s)
               for i, (k, s) in enumerate(shapes.items())}
    got, state = transform.update(updates, state)
    for name, update in updates.items():
      o = np.asarray(update, np.float64)
      flat = (o if name == 'stack' else o.reshape(1, 6, 6))
      nu[name] = 0.9 * nu[name] + 0.1 * (flat ** 2).mean(axis=1)
      scaled = flat / np.sqrt(nu[name])[:, None, :]
      scaled *= (np.linalg.norm(flat, axis=(1, 2))
                 / np.linalg.norm(scaled, axis=(1, 2)))[:, None, None]
      np.testing.assert_allclose(got[name], scaled.reshape(o.shape),
                                 rtol=1e-5, err_msg=f'{name}, step {step}')


def test_normuon_moves_each_matrix_as_far_as_muon_and_the_rest_alike():
  """The normalisation keeps each matrix's Frobenius norm: NorMuon's
  update of a matrix is as large as Muon's, in another direction; AdamW's
  parameters are updated alike."""
  boxed = boxed_params(small(num_layers=1))
  params = jax.tree.map(jnp.ones_like, nn.meta.unbox(boxed))
  gradients = jax.tree.map(
      lambda leaf: jax.random.normal(jax.random.key(leaf.size), leaf.shape),
      params)
  base = dict(warmup_steps=0, schedule='constant', grad_clip_norm=0.0,
              weight_decay=0.0)
  plain = _leaf_updates(_config(optimizer='muon', **base), boxed, params,
                        gradients)
  normed = _leaf_updates(_config(optimizer='normuon', **base), boxed, params,
                         gradients)
  matrices = jax.tree.leaves(hidden_matrices(boxed), is_leaf=is_entry)
  for matrix, a, b in zip(matrices, plain, normed):
    if matrix is None:
      np.testing.assert_array_equal(a, b)
    else:
      assert np.linalg.norm(b) == pytest.approx(np.linalg.norm(a), rel=1e-4)
      assert not np.allclose(a, b, rtol=1e-3)


@pytest.mark.core
@pytest.mark.parametrize('optimizer', ['adamw', 'muon', 'normuon'])
def test_each_rate_an_optimizer_applies_is_logged_under_its_own_key(
    optimizer):
  """Under Muon the matrices move at muon_learning_rate's schedule and the
  other parameters at learning_rate's: both are named, each at its own
  value (here half way through a warm-up)."""
  config = _config(optimizer=optimizer, learning_rate=0.01,
                   muon_learning_rate=0.1, warmup_steps=4,
                   schedule='constant')
  _, rates = optim.make_optimizer(config, boxed_params(small(num_layers=1)))
  want = {'learning_rate': 0.005}
  if optimizer != 'adamw':
    want['muon_learning_rate'] = 0.05
  assert {name: float(rate(2)) for name, rate in rates.items()} == (
      pytest.approx(want))
