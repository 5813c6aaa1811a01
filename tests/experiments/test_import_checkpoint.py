"""experiments.import_checkpoint against Hugging Face's own implementations
(transformers' Flax GPT-2 and Llama, tiny and with random weights, saved
with save_pretrained to safetensors): logits, greedy text through
train.generate, cached decoding; bad checkpoints; fine-tuning an import
with another attention and fewer key/value heads."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
import transformers

from configs import lm_stdlib, published
from model import ModelConfig, build
from model.state import Cache
from tests.helpers import REPO, hf_models, hf_tokenizers
from train import generate
from train.base import storage
from train.base.errors import InputError
from train.config import validation as config_validation
from train.data.tokenizers import ByteTokenizer, HfTokenizer
from experiments.import_checkpoint import import_checkpoint, import_config
from train.run import checkpointing, pretrained, trained_run
from train.run import workdir as workdir_lib
from train.run.trainer import train_and_evaluate

PROMPT = 'def f'


def _import(name: str, tmp_path, data_dir: str, **model) -> tuple:
  """(the reference, the workdir it was imported into with `model`'s
  config.model keys)."""
  reference, saved = hf_models.saved(name, tmp_path)
  config = published.get_config(name)
  config.update(data_dir=data_dir, seq_len=32, batch_size=4)
  config.model.update(model)
  workdir = str(tmp_path / name)
  import_checkpoint(saved, f'hf_{name}', workdir, config)
  return reference, workdir


@pytest.fixture(scope='module')
def gpt2_saved(tmp_path_factory):
  """The tiny GPT-2 reference and its directory (not imported)."""
  return hf_models.saved('gpt2', tmp_path_factory.mktemp('gpt2'))


def _gpt2_config(data_dir: str):
  """The GPT-2 preset at the tests' lengths, for an import."""
  config = published.get_config('gpt2')
  config.update(data_dir=data_dir, seq_len=32, batch_size=4)
  return config


def _relative_error(got, want) -> float:
  return float(np.abs(np.asarray(got) - np.asarray(want)).max()
               / np.abs(np.asarray(want)).max())


def _check_parity(reference, workdir: str) -> None:
  """Logits within 1e-5 relative, cached decoding equal to the full pass,
  and train.generate's greedy text the reference's."""
  run = trained_run.load(workdir)
  # Each pass compiled whole: run op by op, every op compiles on its own.
  apply = jax.jit(functools.partial(run.model.apply, {'params': run.params}))
  logits, _ = apply(hf_models.TOKENS_BxT)
  want = jax.jit(lambda tokens: reference(tokens).logits)(hf_models.TOKENS_BxT)
  assert _relative_error(logits, want) < 1e-5

  # The prompt in one call, then one token a call (one compiled step).
  length = hf_models.TOKENS_BxT.shape[1]
  cache = Cache.empty(run.model_config, hf_models.TOKENS_BxT.shape[0], length)
  positions = jnp.broadcast_to(jnp.arange(length), hf_models.TOKENS_BxT.shape)
  cached, cache = apply(hf_models.TOKENS_BxT[:, :8], positions[:, :8],
                        cache=cache)
  steps = [cached]
  for t in range(8, length):
    step, cache = apply(hf_models.TOKENS_BxT[:, t:t + 1],
                        positions[:, t:t + 1], cache=cache)
    steps.append(step)
  assert _relative_error(jnp.concatenate(steps, 1), logits) < 1e-5

  tokenizer = ByteTokenizer()
  _check_greedy_text(reference, workdir, tokenizer,
                     [tokenizer.eos_id, *tokenizer.encode(PROMPT)])


def _check_greedy_text(reference, workdir: str, tokenizer,
                       prompt_ids: list[int]) -> None:
  """train.generate's greedy 16 tokens after PROMPT, as text, are the
  reference's greedy `generate` (compiled whole) from `prompt_ids`,
  decoded by `tokenizer`."""
  [text] = generate.generate(workdir, PROMPT, max_new_tokens=16,
                             temperature=0.0)
  sequences = jax.jit(lambda ids: reference.generate(
      ids, max_new_tokens=16, do_sample=False, eos_token_id=tokenizer.eos_id,
      pad_token_id=tokenizer.eos_id).sequences)(jnp.asarray([prompt_ids]))
  greedy = np.asarray(sequences[0, len(prompt_ids):])
  ended = np.flatnonzero(greedy == tokenizer.eos_id)
  greedy = greedy[:ended[0]] if ended.size else greedy
  assert text == tokenizer.decode([*prompt_ids, *greedy])


@pytest.mark.slow
def test_gpt2_equals_the_reference_and_fine_tunes_with_another_attention(
    tmp_path, data_dir, capsys):
  """Parity, then the import fine-tuned with a banded attention and half
  its key/value heads (mean-pooled), from its checkpoint named by step:
  the loss is finite and falls."""
  reference, workdir = _import('gpt2', tmp_path, data_dir)
  _check_parity(reference, workdir)
  config = published.get_config(f'from={workdir}/checkpoints/0')
  config.model.attention = 'local'
  config.model.attention_options.local.window = 8
  config.model.num_kv_heads = 2
  config.update(num_train_steps=8, batch_size=8, log_every=2, eval_every=0,
                checkpoint_every=0, num_eval_steps=1, learning_rate=3e-3,
                warmup_steps=1)
  train_and_evaluate(config, str(tmp_path / 'tuned'))
  assert (f'Starting from the parameters of {workdir}/checkpoints/0 at step '
          '0: 28 parameters taken as they are; 8 key/value projection '
          'parameters mean-pooled to fewer heads.') in capsys.readouterr().out
  with open(tmp_path / 'tuned' / 'metrics.jsonl') as f:
    losses = [json.loads(line)['loss'] for line in f
              if '"loss"' in line]
  assert np.all(np.isfinite(losses)) and len(losses) == 4
  assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_llama_equals_the_reference(tmp_path, data_dir):
  """Grouped-query attention, RoPE, RMSNorm, SwiGLU, no biases, an untied
  readout; imported into a model that scans its layers, whose stacked
  cache decodes alike."""
  reference, workdir = _import('llama', tmp_path, data_dir, scan_layers=True)
  assert trained_run.load_config(workdir).model.scan_layers
  _check_parity(reference, workdir)


def test_gpt2_with_its_tokenizer_reads_and_writes_text_in_its_tokens(
    gpt2_saved, tmp_path, data_dir, capsys):
  """A GPT-2 directory holding a tokenizer.json (GPT-2-like, trained here):
  the import copies it into the workdir and the run's config.tokenizer
  names the copy; train.generate's --prompt is read as transformers'
  tokenizer reads it (GPT-2's adds no boundary) and written in its
  tokens, as the reference decodes greedily; a run fine-tuned from the
  import keeps a copy of its own, which outlives the import; an import
  without one says so."""
  reference, saved = gpt2_saved
  with_tokenizer = tmp_path / 'with_tokenizer'
  shutil.copytree(saved, with_tokenizer)
  hf_tokenizers.train('gpt2', with_tokenizer, hf_models.VOCAB)
  # A small corpus: the import and train.generate tokenize it whole.
  config = _gpt2_config(data_dir)
  config.dataset = 'text_files'
  config.dataset_options = {
      'paths': hf_tokenizers.write_corpus(tmp_path / 'corpus')}
  workdir = str(tmp_path / 'w')
  said = import_checkpoint(str(with_tokenizer), 'hf_gpt2', workdir, config)
  assert said.endswith('its config.json, its tokenizer.json and the '
                       'checkpoint of step 0.')
  copy = os.path.join(workdir, 'tokenizer.json')
  assert trained_run.load_config(workdir).tokenizer == copy
  tokenizer = HfTokenizer(copy)
  # Its own ids, not the bytes' (id b + 2).
  assert tokenizer.encode(PROMPT)[0] != ByteTokenizer().encode(PROMPT)[0]
  _check_greedy_text(reference, workdir, tokenizer,
                     transformers.PreTrainedTokenizerFast(
                         tokenizer_file=copy)(PROMPT)['input_ids'])
  tuned = str(tmp_path / 'tuned')
  with workdir_lib.claim(published.get_config(f'from={workdir}'), tuned):
    pass
  shutil.rmtree(workdir)
  assert trained_run.load_config(tuned).tokenizer == os.path.join(
      tuned, 'tokenizer.json')
  assert HfTokenizer(os.path.join(tuned, 'tokenizer.json')).vocab_size == (
      tokenizer.vocab_size)
  import_checkpoint(saved, 'hf_gpt2', str(tmp_path / 'bytes'),
                    _gpt2_config(data_dir))
  assert (f'--from={saved} has no tokenizer.json: the model reads the '
          "token ids of config.dataset='python_stdlib_bytes'."
          in capsys.readouterr().out)


def test_pytorch_names_in_bfloat16_and_two_files_read_alike(gpt2_saved,
                                                            tmp_path):
  """A checkpoint as PyTorch writes GPT-2 (no 'transformer.' prefix,
  `.weight` in Conv1D's [in, out] layout, the causal-mask buffers), in
  bfloat16 and split over two files, reads as the same parameters rounded
  to bfloat16."""
  _, saved = gpt2_saved
  renamed = {}
  for name, array in load_file(os.path.join(saved,
                                            'model.safetensors')).items():
    name = name.removeprefix('transformer.')
    if name.endswith('.kernel'):
      name, array = name[:-len('kernel')] + 'weight', array.T
    name = name.replace('.embedding', '.weight').replace('.scale', '.weight')
    renamed[name] = np.ascontiguousarray(array).astype(jnp.bfloat16)
  renamed['h.0.attn.bias'] = np.tril(np.ones((64, 64), jnp.bfloat16))
  torch_dir = tmp_path / 'torch'
  torch_dir.mkdir()
  names = sorted(renamed)
  for part, chosen in enumerate((names[::2], names[1::2])):
    save_file({name: renamed[name] for name in chosen},
              str(torch_dir / f'model-0000{part + 1}-of-00002.safetensors'))
  shutil.copy(os.path.join(saved, 'config.json'), torch_dir)
  keys = pretrained.model_keys(saved, 'hf_gpt2')
  rounded = jax.tree.map(
      lambda x: np.asarray(x.astype(jnp.bfloat16), np.float32),
      pretrained.params(saved, 'hf_gpt2', keys))
  jax.tree.map(np.testing.assert_array_equal,
               pretrained.params(str(torch_dir), 'hf_gpt2', keys), rounded)


def test_a_tied_llama_as_flax_saves_it_reads_out_through_its_embedding(
    tmp_path, capsys):
  """FlaxLlamaForCausalLM(tie_word_embeddings=True).save_pretrained writes
  an lm_head.kernel beside the embedding, which transformers does not read
  where the config ties them: the logits are h E^T, the reference's with
  its head set to the embedding (the Flax Llama has no tying of its own),
  and the import says that the head is not read."""
  reference = hf_models.reference('llama', tie_word_embeddings=True)
  saved = tmp_path / 'tied'
  reference.save_pretrained(str(saved), safe_serialization=True)
  assert 'lm_head.kernel' in load_file(str(saved / 'model.safetensors'))
  # Whatever the config holds, the import sets the architecture.
  hostile = published.get_config('gpt2')
  hostile.model.update(scale_tied_readout=True, qk_norm='rmsnorm',
                       logit_softcap=30.0, attention='local',
                       norm_position='post')
  hostile.model.attention_options.window = 4
  config, keys = import_config(str(saved), 'hf_llama', hostile)
  model = build(ModelConfig.from_mapping(config.model))
  logits, _ = jax.jit(model.apply)(
      {'params': pretrained.params(str(saved), 'hf_llama', keys)},
      hf_models.TOKENS_BxT)
  assert capsys.readouterr().out == (
      f'--from={saved}: lm_head.kernel is not read: its config.json ties '
      'the readout to the embedding (tie_word_embeddings), as transformers '
      'reads it.\n')
  params = reference.params
  tied = params | {'lm_head': {
      'kernel': params['model']['embed_tokens']['embedding'].T}}
  want = jax.jit(lambda tokens: reference(tokens, params=tied).logits)(
      hf_models.TOKENS_BxT)
  assert _relative_error(logits, want) < 1e-5


def test_a_workdir_that_holds_a_run_is_refused_one_cut_short_completed(
    gpt2_saved, tmp_path, data_dir, capsys):
  """Another import into an import's workdir, of other weights of the same
  shapes, is refused by --workdir. Killed while orbax wrote step 0, an
  import leaves its config.json, the ledger and the unfinished save under
  orbax's temporary name: the same import again completes the workdir.
  The checkpoint, which its checksums verify, is the first one's."""
  _, saved = gpt2_saved
  workdir = str(tmp_path / 'w')
  import_checkpoint(saved, 'hf_gpt2', workdir, _gpt2_config(data_dir))
  other = _damaged(saved, tmp_path / 'other', 'weights')
  with pytest.raises(InputError, match=re.escape(
      f'--workdir={workdir} already holds a run (checkpoints)')):
    import_checkpoint(str(other), 'hf_gpt2', workdir,
                      _gpt2_config(data_dir))
  checkpoints = tmp_path / 'w' / 'checkpoints'
  (checkpoints / '0').rename(
      checkpoints / f'0{checkpointing.INCOMPLETE_SUFFIX}-1700000000')
  import_checkpoint(saved, 'hf_gpt2', workdir, _gpt2_config(data_dir))
  assert 'ignoring the incomplete checkpoint' in capsys.readouterr().out
  assert sorted(path.name for path in checkpoints.iterdir()) == [
      '0', 'checksums.json']
  np.testing.assert_array_equal(
      trained_run.load(workdir).params['embedder']['token_embedding'][
          'embedding'],
      load_file(os.path.join(saved, 'model.safetensors'))[
          'transformer.wte.embedding'])


def test_an_architecture_key_typed_is_refused_a_layout_key_kept(
    gpt2_saved):
  """The checkpoint gives config.model's architecture: typing one of its
  keys is refused by name, and a key the import does not set is kept."""
  _, saved = gpt2_saved
  for key in ('model.d_model', 'model.attention',
              'model.attention_options.local.window'):
    with pytest.raises(InputError, match=re.escape(
        f'--config.{key}: the import takes config.model.'
        f'{key.split(".")[1]} from --from={saved}')):
      import_config(saved, 'hf_gpt2', overrides={key: 1})
  config = published.get_config('gpt2')
  config.model.scan_layers = True
  config, _ = import_config(saved, 'hf_gpt2', config,
                            overrides={'model.scan_layers': True})
  assert config.model.scan_layers


def _damaged(saved: str, target, change: str) -> str:
  """A copy of the checkpoint in `saved` with one thing wrong."""
  shutil.copytree(saved, target)
  config_path = os.path.join(target, 'config.json')
  with open(config_path) as f:
    values = json.load(f)
  tensors_path = os.path.join(target, 'model.safetensors')
  if change == 'no config.json':
    os.remove(config_path)
  elif change == 'no tensors':
    os.remove(tensors_path)
  elif change in ('model_type', 'activation_function'):
    values[change] = {'model_type': 'bert',
                      'activation_function': 'relu'}[change]
  elif change == 'attnlab workdir':
    values = json.loads(published.get_config('gpt2').to_json_best_effort())
  else:
    tensors = load_file(tensors_path)
    name = 'transformer.h.1.mlp.c_fc.bias'
    if change == 'vocab_size':  # A consistent checkpoint of 100 tokens.
      values['vocab_size'] = 100
      name = 'transformer.wte.embedding'
      tensors[name] = tensors[name][:100]
    elif change == 'two files':
      save_file({name: tensors[name]},
                os.path.join(target, 'extra.safetensors'))
    elif change == 'weights':  # Others of the same shapes.
      tensors = {key: value + 1 for key, value in tensors.items()}
    elif change == 'shape':
      tensors[name] = tensors[name][:-1]
    elif change == 'missing':
      del tensors[name]
    else:
      tensors['transformer.h.2.mlp.c_fc.bias'] = tensors[name]
    save_file(tensors, tensors_path)
  if change != 'no config.json':
    with open(config_path, 'w') as f:
      json.dump(values, f)
  return target


BAD = {
    'no config.json': 'has no config.json',
    'no tensors': 'holds no *.safetensors file',
    'model_type': "model_type='bert' is not the architecture",
    'attnlab workdir': "is an attnlab training run's workdir, which needs no "
                       'import: fine-tune it with --config=configs/'
                       'published.py:from=',
    'activation_function': "activation_function='relu' is not supported",
    'shape': 'h.1.mlp.c_fc.bias has shape [127]; its config.json gives [128]',
    'missing': 'has no tensor h.1.mlp.c_fc.bias',
    'extra': 'holds tensors this format does not read (1: h.2.mlp.c_fc.bias)',
    'two files': 'the tensor h.1.mlp.c_fc.bias is in more than one file',
    # The tokenizer's ids (the dataset's) must fit the vocabulary.
    'vocab_size': 'its vocab_size=100 is smaller than the 258 token ids',
}


@pytest.mark.parametrize('change', list(BAD))
def test_bad_checkpoints_are_refused(gpt2_saved, tmp_path, data_dir, change):
  _, saved = gpt2_saved
  damaged = _damaged(saved, tmp_path / 'damaged', change)
  with pytest.raises(InputError, match=re.escape(BAD[change])):
    import_checkpoint(str(damaged), 'hf_gpt2', str(tmp_path / 'w'),
                      _gpt2_config(data_dir))
  assert not os.path.exists(tmp_path / 'w')


LLAMA_REFUSED = {
    'attention_bias': (True, 'attention_bias=True and mlp_bias=False differ'),
    'rope_scaling': ({'rope_type': 'llama3'}, "rope_scaling={'rope_type': "),
    'rope_parameters': ({'rope_type': 'yarn', 'rope_theta': 1e4},
                        "rope_parameters.rope_type='yarn' is not supported"),
    'partial_rotary_factor': (0.5, 'partial_rotary_factor=0.5 is not '
                              'supported'),
    'hidden_act': ('gelu', "hidden_act='gelu' is not supported"),
}


@pytest.mark.parametrize('key', list(LLAMA_REFUSED))
def test_llama_configs_the_model_cannot_express(tmp_path, key):
  value, message = LLAMA_REFUSED[key]
  with open(tmp_path / 'config.json', 'w') as f:
    json.dump({'model_type': 'llama', 'hidden_size': 32,
               'num_attention_heads': 4, 'num_hidden_layers': 1,
               'intermediate_size': 64, 'vocab_size': hf_models.VOCAB,
               key: value}, f)
  with pytest.raises(InputError, match=re.escape(message)):
    pretrained.model_keys(str(tmp_path), 'hf_llama')


# id: (module, arguments, the line after 'error: '). {hf}: the tiny GPT-2's
# directory; {tmp}: an empty directory, whose garbled/ holds a config.json
# that is not JSON.
COMMANDS = {
    'not a model directory': (
        'experiments.import_checkpoint',
        ['--from={tmp}', '--format=hf_llama', '--workdir={tmp}/w'],
        '--from={tmp} has no config.json: it must be a Hugging Face model '
        'directory.'),
    'an architecture key': (
        'experiments.import_checkpoint',
        ['--from={hf}', '--format=hf_gpt2', '--workdir={tmp}/w',
         '--config=configs/published.py:gpt2', '--config.model.num_layers=4'],
        '--config.model.num_layers: the import takes config.model.num_layers '
        'from --from={hf} (its architecture); change it when fine-tuning the '
        'import: --config=configs/published.py:from=WORKDIR '
        '--config.model.num_layers=...'),
    'fine-tuning a model directory': (
        'train.train',
        ['--config=configs/published.py:from={hf}', '--workdir={tmp}/t'],
        "--config=configs/published.py:from={hf}: {hf}/config.json is not a "
        "training run's (a Hugging Face directory is imported first: python "
        '-m experiments.import_checkpoint).'),
    'fine-tuning a garbled run': (
        'train.train',
        ['--config=configs/published.py:from={tmp}/garbled',
         '--workdir={tmp}/t'],
        '--config=configs/published.py:from={tmp}/garbled: '
        '{tmp}/garbled/config.json cannot be read ('),
    # {tmp}/alibi holds the config.json of make train's model.
    'exporting a model the format cannot express': (
        'experiments.export_checkpoint',
        ['--workdir={tmp}/alibi', '--format=hf_gpt2', '--to={tmp}/out'],
        "--format=hf_gpt2 cannot express this run's model: config.model "
        "differs in value_residual (True -> False), smear (True -> False), "
        "logit_softcap (30.0 -> 0.0), qk_norm ('rmsnorm' -> 'none'), "
        "position ('alibi' -> 'learned'), attention (('local', 'local') -> "
        "'dense'), attention_options (((('window', 256),), (('window', 64),"
        ")) -> ()), tie_embeddings (False -> True), scale_tied_readout "
        "(True -> False) (the run's value -> the format's)."),
}


@pytest.fixture(scope='module')
def outcomes(gpt2_saved, tmp_path_factory) -> dict[str, tuple[dict, str]]:
  """{id: (what the command did, the line it should begin with)}, every
  command run by one process (tests/helpers/cli_cases.py)."""
  tmp = tmp_path_factory.mktemp('commands')
  (tmp / 'garbled').mkdir()
  (tmp / 'garbled' / 'config.json').write_text('{')
  (tmp / 'alibi').mkdir()
  (tmp / 'alibi' / 'config.json').write_text(
      lm_stdlib.get_config().to_json_best_effort())
  named = lambda text: text.format(tmp=tmp, hf=gpt2_saved[1])
  cases = [(module, list(map(named, args)))
           for module, args, _ in COMMANDS.values()]
  result = subprocess.run(
      [sys.executable, str(REPO / 'tests' / 'helpers' / 'cli_cases.py'),
       json.dumps(cases)], cwd=REPO, capture_output=True, text=True,
      timeout=300, check=True)
  done = json.loads(result.stdout.splitlines()[-1])
  return {case: (outcome, named(line)) for (case, (_, _, line)), outcome
          in zip(COMMANDS.items(), done)}


@pytest.mark.parametrize('case', list(COMMANDS))
def test_a_mistake_is_one_line_naming_it_with_status_2(case, outcomes):
  outcome, line = outcomes[case]
  assert outcome['status'] == 2, outcome
  assert outcome['stderr'].startswith(f'error: {line}'), outcome['stderr']
  assert len(outcome['stderr'].splitlines()) == 1, outcome['stderr']


def test_a_run_on_a_bucket_is_fine_tuned_from_its_url(object_store,
                                                      tmp_path):
  """configs/published.py:from=gs://... reads the run's config.json there
  and starts from it, the URL kept as it was typed."""
  run = f'{object_store}/{tmp_path.name}/run'
  recorded = published.get_config('llama')
  storage.write_whole(storage.path(run) / 'config.json',
                      recorded.to_json_best_effort())
  config = published.get_config(f'from={run}/')
  assert config.init_from == run
  assert config.model.to_dict() == recorded.model.to_dict()


def test_the_gpt2_preset_is_gpt2_small(monkeypatch):
  """configs/published.py:gpt2 holds GPT-2 small's 124,439,808 parameters
  (its published count, learned positions included)."""
  # Its step is sized for an accelerator, not for one of the 8 CPU devices
  # sharing this machine's memory: the check of its memory is not this one.
  monkeypatch.setattr(config_validation, 'device_bytes', lambda: 2**40)
  checked = config_validation.check(published.get_config('gpt2'),
                                    jax.devices()[:1])
  sizes = [leaf.value.size for leaf in jax.tree.leaves(
      checked.param_shapes, is_leaf=lambda leaf: hasattr(leaf, 'value'))]
  assert sum(sizes) == 124_439_808
