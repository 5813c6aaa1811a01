"""Attention functions by name, all on the dense core's signature:

  fn(query [B, T, N, H], key [B, S, K, H], value [B, S, K, H], bias=None,
     mask=None, *, scale=None, is_causal=False, **options) -> [B, T, N, H]

`get(name)` returns the function, `names()` lists them, and `spec(name)`
says what a function honours (causal, which masks, bias, dropout), so that a
config asking for something a variant cannot do is refused before anything
is compiled. Each function also raises a ValueError itself when called with
an input it cannot honour.

The functions live in rooms, each importing only from the rooms listed
before it; the registry here and a variant's options (options.py) stand
above them:

  core/      what the rooms share: the dense core (masks and score
             functions as objects, the softmax with its sinks), the
             online softmax, block patterns, the logical axis names
  kernels/   the fused kernels and the table that chooses one for a case
             (fused.py), the project's general Pallas kernel (flex*.py)
  variants/  each variant's math, a module per idea, on the core's
             signature, running on the kernels where one computes it

A new variant is a module in variants/ and its line in _REGISTRY.
"""

from collections.abc import Callable
import dataclasses
import inspect
import os
from typing import Any

import jax

from model.attention.core import (PositionBias, SegmentMask,
                                  attention_weights, causal_attention,
                                  causal_mask, cross_attention, lookup,
                                  scaled_dot_product_attention)
from model.attention.variants import (additive, chunked, compressed, gated,
                                      kernel, latent, linformer, moba, ring,
                                      sparse)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Variant:
  """A registered attention function and the inputs it honours."""

  fn: Callable[..., Array]
  # is_causal=True.
  causal: bool
  # 'any' mask broadcastable to [B, N, T, S]; only 'key_padding' masks
  # of shape [B, 1, 1, S] (with a T axis of 1); or 'segments': those and
  # packed rows (a SegmentMask of self-attention).
  masks: str
  # An additive bias on the logits.
  bias: bool
  # dropout_rate and dropout_rng (dropout on the attention weights).
  dropout: bool
  # Self-attention only (T == S, queries and keys at the same positions).
  self_only: bool = False
  # Causal attention with more keys than queries (T < S, the queries being
  # the last T positions): what a Transformer-XL memory or a cache needs.
  longer_keys: bool = False
  # Scores are functions of q . k (exactly, or estimated as by performer),
  # so rotating queries and keys by position (rope) makes them relative.
  dot_product: bool = True
  # The parameters it owns, or None: parameters(module, config, **options)
  # creates them in the attention layer `module` for a layer of `config`
  # (a ModelConfig), its keyword-only arguments being the options that
  # shape them, and returns fn's keyword arguments (the parameters and the
  # other options). A variant with parameters needs nothing else from the
  # model (options.py).
  parameters: Callable[..., dict[str, Any]] | None = None
  # Computes dense's function (softmax over every allowed key) exactly, by
  # another algorithm or layout, not an approximation or a sparser pattern.
  exact: bool = False
  # A sparse pattern that decoding reads a key/value cache through:
  # cache_pattern(**options) -> allowed(q_positions, kv_positions), True
  # where a query may see a key (the causal part aside), under which
  # decoding attends as dense does; None for none.
  cache_pattern: Callable[..., Callable[[Array, Array], Array]] | None = None
  # fn takes the layer's input x [B, T, D] as `inputs` (gates computed
  # from it by the variant's parameters).
  reads_inputs: bool = False
  # Causal only (is_causal=True always): a recurrence over the positions.
  causal_only: bool = False
  # Decoding carries a recurrent state (model.state.RecurrentState) in
  # place of keys and values, or None: decoding_state(config, batch_size)
  # gives its zeros (a tree of arrays, rows first) for a layer of `config`
  # (a ModelConfig); fn takes `state`, the state before the call's first
  # position, and then returns (out, the state after its last).
  decoding_state: Callable[..., Any] | None = None
  # Makes the layer's queries, keys and values itself, from a shared
  # low-rank latent (model/attention/variants/latent.py), in place of
  # MultiHeadAttention's projections, or None: latent_projections(config,
  # **options) gives the Flax module (a latent.LatentProjections), its
  # keyword-only arguments being the options that shape it; fn attends
  # over what it makes, and decoding caches its latents
  # (model.state.LatentCache).
  latent_projections: Callable[..., Any] | None = None

  @property
  def sinks(self) -> bool:
    """Takes attention sinks (fn's `sinks`: a logit per query head [N] in
    each row's softmax normaliser, core.sink_softmax): every variant
    whose weights are a softmax over keys."""
    return 'sinks' in inspect.signature(self.fn).parameters

  @property
  def carries_state(self) -> bool:
    """Decoding carries a recurrent state (decoding_state)."""
    return self.decoding_state is not None

  @property
  def packs(self) -> bool:
    """Keeps packed rows apart (takes a SegmentMask)."""
    return self.masks in ('any', 'segments')

  @property
  def reads_cache(self) -> bool:
    """Decoding with a cache: of keys and values (queries after more keys,
    under a mask saying which cache positions are written, and its
    cache_pattern where it has one), or of a recurrent state."""
    return (self.longer_keys and self.masks == 'any') or (
        self.cache_pattern is not None) or self.carries_state


_REGISTRY: dict[str, Variant] = {
    'dense': Variant(scaled_dot_product_attention, causal=True, masks='any',
                     bias=True, dropout=True, longer_keys=True, exact=True),
    'chunked': Variant(chunked.chunked_attention, causal=True, masks='any',
                       bias=True, dropout=False, longer_keys=True,
                       exact=True),
    'local': Variant(sparse.local_attention, causal=True, masks='any',
                     bias=True, dropout=False, self_only=True,
                     cache_pattern=sparse.local_pattern),
    'strided': Variant(sparse.strided_attention, causal=True, masks='any',
                       bias=True, dropout=False, self_only=True),
    'fixed': Variant(sparse.fixed_attention, causal=True, masks='any',
                     bias=True, dropout=False, self_only=True),
    'bigbird': Variant(sparse.bigbird_attention, causal=True, masks='any',
                       bias=True, dropout=False, self_only=True),
    'linformer': Variant(linformer.linformer_attention, causal=False,
                         masks='key_padding', bias=False, dropout=False,
                         dot_product=False,
                         parameters=linformer.parameters),
    'performer': Variant(kernel.performer_attention, causal=True,
                         masks='key_padding', bias=False, dropout=False),
    'linear': Variant(kernel.linear_attention, causal=True,
                      masks='key_padding', bias=False, dropout=False,
                      dot_product=False),
    'hedgehog': Variant(kernel.hedgehog_attention, causal=True,
                        masks='key_padding', bias=False, dropout=False,
                        dot_product=False,
                        parameters=kernel.hedgehog_parameters),
    'ring': Variant(ring.ring_attention, causal=True, masks='any', bias=True,
                    dropout=False, self_only=True, exact=True),
    'memory_compressed': Variant(
        compressed.memory_compressed_attention, causal=True,
        masks='key_padding', bias=False, dropout=False, self_only=True,
        dot_product=False, parameters=compressed.parameters),
    'additive': Variant(additive.additive_attention, causal=True, masks='any',
                        bias=True, dropout=False, longer_keys=True,
                        dot_product=False, parameters=additive.parameters),
    'moba': Variant(moba.moba_attention, causal=True, masks='key_padding',
                    bias=False, dropout=False, self_only=True),
    'mla': Variant(chunked.chunked_attention, causal=True, masks='any',
                   bias=False, dropout=False, longer_keys=True,
                   latent_projections=latent.projections),
    **{name: Variant(fn, causal=True, masks='segments', bias=False,
                     dropout=False, self_only=True, parameters=parameters,
                     reads_inputs=name != 'retnet', causal_only=True,
                     decoding_state=gated.decoding_state)
       for name, fn, parameters in (
           ('retnet', gated.retnet_attention, gated.conv_parameters),
           ('mamba2', gated.mamba2_attention, gated.ssm_parameters),
           ('gla', gated.gla_attention, gated.gla_parameters),
           ('deltanet', gated.deltanet_attention, gated.delta_parameters),
           ('gated_deltanet', gated.gated_deltanet_attention,
            gated.gated_delta_parameters))},
}


# The variants `register` added, by name: the file whose code called it
# (None: code in no file, an interpreter's).
_ADDED: dict[str, str | None] = {}


def register(name: str, variant: Variant) -> None:
  """Adds `variant` under a new `name` (e.g. one of flex_variant.variant,
  a variant given by its score function and pattern): configs, models and
  the benchmarks then take it as any other. ValueError for a name taken."""
  if name in _REGISTRY or name == 'auto':
    raise ValueError(f'attention {name!r} is registered already.')
  _REGISTRY[name] = variant
  # The caller's file: a run records it, and a reader runs it again.
  caller = inspect.currentframe().f_back.f_globals.get('__file__')
  _ADDED[name] = os.path.abspath(caller) if caller else None


def added() -> dict[str, str | None]:
  """{name: the file that registered it (None: no file)} of the variants
  added by `register`, not built in."""
  return dict(_ADDED)


def names() -> list[str]:
  """Names of the registered attention functions, sorted."""
  return sorted(_REGISTRY)


def spec(name: str) -> Variant:
  """The registry entry of `name`: its function and what it honours."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(
        f'unknown attention {name!r}; registered: {", ".join(names())}.'
    ) from None


def exact_names() -> list[str]:
  """Names of the attention functions that compute dense's exactly."""
  return [name for name in names() if _REGISTRY[name].exact]


def fastest_exact(*, dropout: bool = False) -> str:
  """The exact attention to use where the choice is free ('auto'):
  chunked, which skips the blocks a causal mask removes and never holds
  [T, S] logits (and runs on the backend's fused kernel where one computes
  the case, see fused.py); dense where attention dropout is wanted, which
  only dense applies. experiments/bench_attention.py measures the choice."""
  return 'dense' if dropout else 'chunked'


def get(name: str) -> Callable[..., Array]:
  """The attention function registered under `name`."""
  return spec(name).fn


__all__ = ['PositionBias', 'SegmentMask', 'Variant', 'added',
           'attention_weights', 'causal_attention', 'causal_mask',
           'cross_attention', 'fastest_exact', 'get', 'lookup', 'names',
           'register', 'scaled_dot_product_attention', 'spec']
