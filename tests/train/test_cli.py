"""Every command line speaks one language: a mistake in what was typed is
one line, `error: ...`, naming it (and the nearest valid name), with exit
status 2 and no traceback; a failure of the run itself is one line with
exit status 1, its traceback in a log file."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from model import ModelConfig
from tests.helpers import REPO
from train import cli
from train.base.errors import InputError
from train.config import validation as config_validation

LM = '--config=configs/lm_stdlib.py'
LISTOPS = '--config=configs/listops.py'
TRAIN = ['--', 'python', '-m', 'train.train', LM, '--workdir=/tmp/run']
TPU = ['--tpu=pod', '--zone=z', '--accelerator=v5p-8', '--dry_run']

# id: (module or file, arguments, what the one line says). {tmp} is a
# fresh directory; {edited} a copy of the checkout with an edit.
CASES = {
    'train_key': ('train.train', [LM, '--workdir={tmp}/w',
                                  '--config.model.dmodel=64'],
                  "--config.model.dmodel=64: config.model has no key "
                  "'dmodel'; did you mean d_model?"),
    'train_value': ('train.train', [LM, '--workdir={tmp}/w',
                                    '--config.model.num_heads=3'],
                    'config.model.num_heads=3 does not divide'),
    'train_type': ('train.train', [LM, '--workdir={tmp}/w',
                                   '--config.model.tie_embeddings=maybe'],
                   '--config.model.tie_embeddings=maybe: must be True or '
                   'False.'),
    'train_integer': ('train.train', [LM, '--workdir={tmp}/w',
                                      '--config.num_train_steps=abc'],
                      '--config.num_train_steps=abc: must be an integer.'),
    'train_number': ('train.train', [LM, '--workdir={tmp}/w',
                                     '--config.learning_rate=1e'],
                     '--config.learning_rate=1e: must be a number.'),
    'train_choice': ('train.train', [LM, '--workdir={tmp}/w',
                                     '--config.schedule=cosin'],
                     "config.schedule='cosin' must be one of ['cosine', "
                     "'linear', 'rsqrt', 'constant', 'wsd']; did you mean "
                     "cosine?"),
    'train_config_argument': (
        'train.train', ['--config=configs/algorithmic.py:task=divide',
                        '--workdir={tmp}/w'],
        "configs/algorithmic.py takes task=<one of ('copy', 'reverse', "
        "'sort', 'addition')>, got 'task=divide'."),
    'train_config_path': ('train.train', ['--config=configs/lm_stdlb.py',
                                          '--workdir={tmp}/w'],
                          '--config=configs/lm_stdlb.py: no such file; did '
                          'you mean configs/lm_stdlib.py?'),
    'train_config_without_py': (
        'train.train', ['--config=configs/lm_stdlib', '--workdir={tmp}/w'],
        'no such file; did you mean configs/lm_stdlib.py?'),
    'train_no_workdir': ('train.train', [LM], '--workdir is required: '),
    'train_unknown_flag': ('train.train', [LM, '--workdir={tmp}/w',
                                           '--worddir=x'],
                           'unknown flag --worddir; did you mean --workdir?'),
    'train_stray_argument': ('train.train', [LM, '--workdir={tmp}/w', 'x'],
                             'unexpected arguments: x'),
    'train_config_key_as_a_flag': (
        'train.train', [LM, '--workdir={tmp}/w', '--num_train_steps=20'],
        'unknown flag --num_train_steps; did you mean '
        '--config.num_train_steps?'),
    'train_config_outside_configs': (
        'train.train',
        ['--config=lm_stdlib.py:baseline', '--workdir={tmp}/w'],
        '--config=lm_stdlib.py:baseline: no such file; did you mean '
        'configs/lm_stdlib.py:baseline?'),
    'train_attention_option': (
        'train.train', [LM, '--workdir={tmp}/w', '--config.model.attention='
                        'local', '--config.model.attention_options.windw=32'],
        "--config.model.attention_options.windw=32: config.model."
        "attention_options has no key 'windw'; did you mean window?"),
    'train_attention_option_by_name': (
        'train.train', [LM, '--workdir={tmp}/w', '--config.model.attention='
                        'dense,local',
                        '--config.model.attention_options.local.kernl=xla'],
        "config.model.attention_options.local has no key 'kernl'; did you "
        'mean kernel?'),
    'train_attention_name': (
        'train.train', [LM, '--workdir={tmp}/w',
                        '--config.model.attention=lokal'],
        "config.model.attention='lokal' must be one of ['auto', 'additive', "
        "'bigbird', 'chunked', 'deltanet', 'dense', 'fixed', "
        "'gated_deltanet', 'gla', 'hedgehog', 'linear', 'linformer', "
        "'local', 'mamba2', 'memory_compressed', 'mla', 'moba', "
        "'performer', 'retnet', 'ring', 'strided']; did you mean local?"),
    'train_attention_entry_name': (
        'train.train', [LM, '--workdir={tmp}/w',
                        '--config.model.attention=dense,lokal'],
        "config.model.attention[1]='lokal' must be one of ['auto', "),
    'train_position_name': (
        'train.train', [LM, '--workdir={tmp}/w',
                        '--config.model.position=alibii'],
        "config.model.position='alibii' must be one of ['none', "
        "'sinusoidal', 'learned', 'random_sinusoidal', 'relative', "
        "'t5_bias', 'rope', 'alibi', 'deberta']; did you mean alibi?"),
    'generate_no_workdir': ('train.generate', [], '--workdir is required'),
    'generate_not_a_run': ('train.generate', ['--workdir={tmp}/none'],
                           "--workdir must be a training run's workdir"),
    'translate_no_workdir': ('train.translate', [], '--workdir is required'),
    'compare_variant': (
        'experiments.compare_attention',
        [LISTOPS, '--variants=dense,chunkd', '--workdir={tmp}/c'],
        "--variants: no attention variant 'chunkd'; did you mean chunked?"),
    'compare_option_variant': (
        'experiments.compare_attention',
        [LISTOPS, '--variants=dense', '--options=local.window=4',
         '--workdir={tmp}/c'], "--options: 'local' is not among --variants"),
    'compare_option': (
        'experiments.compare_attention',
        [LISTOPS, '--variants=dense,local', '--options=local.windw=32',
         '--workdir={tmp}/c'], "--options: local.windw: local has no option "
        "'windw'; did you mean window?"),
    'compare_unrunnable': (
        'experiments.compare_attention',
        [LM, '--variants=dense,linformer', '--workdir={tmp}/c'],
        "--variants: linformer cannot run this config (linformer: config."
        "model.attention='linformer' cannot be causal"),
    'compare_lengths': (
        'experiments.compare_attention',
        [LISTOPS, '--variants=dense', '--lengths=64,0', '--workdir={tmp}/c'],
        '--lengths=64,0 must be positive integers.'),
    'compare_no_variants': ('experiments.compare_attention',
                            [LISTOPS, '--workdir={tmp}/c'],
                            '--variants is required'),
    'sweep_without_get_sweep': ('experiments.sweep',
                                ['--config=configs/lm_systems.py',
                                 '--workdir={tmp}/s'],
                                'configs/lm_systems.py defines no '
                                'get_sweep()'),
    'sweep_metric': ('experiments.sweep',
                     [LISTOPS, '--workdir={tmp}/s', '--metric=eval_acc'],
                     '--metric=eval_acc: no trial logs it; did you mean '
                     'eval_accuracy?'),
    'sweep_key': ('experiments.sweep',
                  [LISTOPS, '--workdir={tmp}/s', '--set=model.dmodel=64'],
                  "config.model has no key 'dmodel'; did you mean d_model?"),
    'sweep_set_key': ('experiments.sweep',
                      [LISTOPS, '--workdir={tmp}/s',
                       '--set=num_train_step=3'],
                      "--set=num_train_step=3: config has no key "
                      "'num_train_step'; did you mean num_train_steps?"),
    'sweep_set_value': ('experiments.sweep',
                        [LISTOPS, '--workdir={tmp}/s',
                         '--set=model.num_heads=x'],
                        '--set=model.num_heads=x: must be an integer.'),
    'sweep_parallel': ('experiments.sweep',
                       ['--config=configs/length_generalisation.py',
                        '--workdir={tmp}/p', '--parallel=0'],
                       '--parallel=0: must be a positive integer.'),
    'sweep_search_parallel': ('experiments.sweep',
                              [LISTOPS, '--workdir={tmp}/p', '--parallel=-1'],
                              '--parallel=-1: must be a positive integer.'),
    'sweep_no_workdir': ('experiments.sweep', [LISTOPS],
                         '--workdir is required'),
    'sweep_bucket': ('experiments.sweep', [LISTOPS, '--workdir=gs://b/s'],
                     '--workdir=gs://b/s: an experiment keeps its tables, '
                     'plots and trials in a directory'),
    'sweep_study_of_a_grid': (
        'experiments.sweep',
        ['--config=configs/length_generalisation.py', '--workdir={tmp}/s',
         '--study=sqlite:///{tmp}/s.db'],
        '--study: get_sweep() of configs/length_generalisation.py is a '
        'grid'),
    'sweep_search_metric': ('experiments.sweep',
                            [LISTOPS, '--workdir={tmp}/s', '--metric=loss'],
                            '--metric=loss: a search ranks and prunes by a '
                            'metric of the evaluation'),
    'launch_sweep_no_study': ('experiments.launch',
                              ['--slurm', '--sweep', '--dry_run', '--',
                               'python', '-m', 'experiments.sweep', LISTOPS,
                               '--workdir=/tmp/s'],
                              '--sweep: the workers share one study'),
    'launch_sweep_sqlite_on_tpu': (
        'experiments.launch',
        ['--sweep', *TPU, '--', 'python', '-m', 'experiments.sweep', LISTOPS,
         '--workdir=/tmp/s', '--study=sqlite:///s.db'],
        'TPU VMs share no file system that SQLite can lock'),
    'launch_no_command': ('experiments.launch', ['--slurm', '--dry_run'],
                          'give the training command after --'),
    'launch_no_tpu': ('experiments.launch', ['--dry_run', *TRAIN],
                      '--tpu, --zone, --accelerator required'),
    'launch_uncommitted': ('{edited}/experiments/launch.py', TPU + TRAIN,
                           'uncommitted edits would not run on the workers '
                           '(git archive HEAD copies the last commit): '
                           'new.py; commit them, or give '
                           '--include_uncommitted.'),
    'maps_no_workdir': ('experiments.attention_maps', [],
                        '--workdir is required'),
    'report_no_out': ('experiments.accelerator_report', [],
                      '--out is required'),
    'bench_attention_flag': ('experiments.bench_attention', ['--lenghts=8'],
                             'did you mean --lengths?'),
    'bench_attention_variant': ('experiments.bench_attention',
                                ['--variants=chunkd', '--out={tmp}/b'],
                                "--variants: unknown attention 'chunkd'; did "
                                'you mean chunked?'),
    'bench_attention_kernel': ('experiments.bench_attention',
                               ['--variants=chunked[palas_gpu]',
                                '--out={tmp}/b'],
                               "--variants: 'chunked[palas_gpu]': no kernel "
                               "'palas_gpu'; did you mean pallas_gpu?"),
    'bench_train_key': ('experiments.bench_train',
                        ['--config.modle.d_model=8'],
                        "config has no key 'modle'; did you mean model?"),
    'bench_seq2seq_flag': ('experiments.bench_seq2seq', ['--step=3'],
                           'did you mean --steps?'),
    'profile_flag': ('experiments.profile', ['--bogus'],
                     'unknown flag --bogus.'),
}

# What a case says on stdout before its error: make train's windows left
# out where the command line replaced its attention.
SAID = {
    case: ("config.model.attention_options (local.window=(256, 64)) left "
           'out: the config file set these for the attention that '
           f"--config.model.attention={attention!r} replaced.\n")
    for case, attention in (('train_attention_name', 'lokal'),
                            ('train_attention_entry_name', 'dense,lokal'))}


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory) -> dict[str, dict]:
  """Every case, run by one process (tests/helpers/cli_cases.py)."""
  tmp = tmp_path_factory.mktemp('cli')
  # A checkout of launch.py alone, with an edit not committed.
  edited = tmp / 'checkout'
  (edited / 'experiments').mkdir(parents=True)
  (edited / 'experiments' / 'launch.py').write_bytes(
      (REPO / 'experiments' / 'launch.py').read_bytes())
  git = ['git', '-C', str(edited), '-c', 'user.name=test',
         '-c', 'user.email=test@localhost']
  for command in (['init', '-q'], ['add', '.'], ['commit', '-qm', 'launch']):
    subprocess.run(git + command, check=True)
  (edited / 'new.py').write_text('')
  cases = [(target.format(edited=edited),
            [arg.format(tmp=tmp) for arg in args])
           for target, args, _ in CASES.values()]
  result = subprocess.run(
      [sys.executable, str(REPO / 'tests' / 'helpers' / 'cli_cases.py'),
       json.dumps(cases)], cwd=REPO, capture_output=True, text=True,
      timeout=300, check=True)
  return dict(zip(CASES, json.loads(result.stdout.splitlines()[-1])))


@pytest.mark.parametrize('case', sorted(CASES))
def test_a_mistake_is_one_line_and_status_2(case, outcomes):
  outcome = outcomes[case]
  assert outcome['stderr'].splitlines() == [
      outcome['stderr'].strip()], outcome['stderr']
  assert outcome['stderr'].startswith('error: ')
  assert CASES[case][2] in outcome['stderr']
  # Python's own wording, or an exception's name, never reaches the user.
  assert not re.search(r'Error: |invalid literal|Non-boolean|could not '
                       r'convert', outcome['stderr']), outcome['stderr']
  assert outcome['status'] == 2
  assert outcome['stdout'] == SAID.get(case, '')


def test_a_config_files_error_is_said_once_without_its_type(tmp_path):
  """An InputError raised by a config file, whose message names the file
  and its argument as the flag does."""
  path = tmp_path / 'presets.py'
  path.write_text(
      'from train.base.errors import InputError\n\n\n'
      'def get_config(arg):\n'
      "  raise InputError(f'{__file__}:{arg}: no preset {arg!r}.')\n")
  with pytest.raises(InputError) as error:
    cli.load_config(f'{path}:big', {})
  assert str(error.value) == f"--config={path}:big: no preset 'big'."


def test_a_failure_of_the_run_is_one_line_and_status_1(capsys):
  with pytest.raises(SystemExit) as stop:
    cli.outcome(lambda: 1 / 0)
  assert stop.value.code == 1
  [line] = capsys.readouterr().err.splitlines()
  log = re.fullmatch(r'error: ZeroDivisionError: division by zero '
                     r'\(traceback in (\S+); --verbose prints it\)', line)
  assert log, line
  text = pathlib.Path(log.group(1)).read_text()
  os.remove(log.group(1))
  assert 'Traceback' in text and '1 / 0' in text


def test_an_interrupted_command_says_so_with_status_130(capsys):
  def interrupted():
    raise KeyboardInterrupt
  with pytest.raises(SystemExit) as stop:
    cli.outcome(interrupted)
  assert stop.value.code == 130
  assert capsys.readouterr().err == 'Interrupted.\n'


def test_an_attention_typed_leaves_out_the_files_options_for_another(
    capsys):
  """make train's config, its windows set for 'local,local', with chunked
  attention: the windows left out in one line, and a config that checks
  (its model traced on the task's batches)."""
  config = cli.load_config('configs/lm_stdlib.py',
                           {'model.attention': 'chunked'})
  assert capsys.readouterr().out == (
      'config.model.attention_options (local.window=(256, 64)) left out: '
      'the config file set these for the attention that '
      "--config.model.attention='chunked' replaced.\n")
  model = config_validation.validate(config).model
  assert (model.attention, model.attention_options) == ('chunked', ())


def test_a_pattern_typed_leaves_out_the_files_values_per_occurrence(
    capsys):
  """One window for each of 'local,local', where the command line names
  local once (--set as a sweep types it)."""
  config = cli.load_config('configs/lm_stdlib.py',
                           {'model.attention': 'local'}, typed='--set=')
  assert "--set=model.attention='local' replaced." in capsys.readouterr().out
  model = ModelConfig.from_mapping(config.model)
  assert (model.attention, model.attention_options) == ('local', ())


def test_a_flat_option_typed_replaces_the_files_under_the_attentions_name(
    capsys):
  """make train's windows, set under local's name, and one typed flat for
  one local attention: the one typed, and nothing said."""
  config = cli.load_config('configs/lm_stdlib.py', {
      'model.attention': 'local', 'model.attention_options.window': 16})
  model = ModelConfig.from_mapping(config.model)
  assert (model.attention, model.attention_options) == (
      'local', (('window', 16),))
  assert capsys.readouterr().out == ''


def test_an_option_typed_for_an_attention_not_in_the_pattern_is_refused():
  config = cli.load_config('configs/lm_stdlib.py', {
      'model.attention': 'chunked',
      'model.attention_options.local.window': 16})
  with pytest.raises(InputError, match=(
      r"^config.model.attention_options.local names no entry of "
      r"config.model.attention='chunked'\.$")):
    config_validation.validate(config)
