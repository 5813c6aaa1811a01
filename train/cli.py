"""What the command lines share: their flag parsing, their errors and their
exit statuses.

  0  done; also a training run that a signal stopped after it saved (the
     trainer says where)
  1  the run itself failed: non-finite values or a failed save
     (TrainingError), or any other error (its traceback goes to a log file
     whose path is printed, or to the terminal with --verbose)
  2  a mistake in what was typed: a flag, a config file or key, a config
     value, a variant, a metric, a workdir, a dataset (InputError)
  130  interrupted (Ctrl-C) without a traceback, where the command does not
     stop on it by itself (the trainer saves and exits with 0)
Each error is one line on stderr, `error: ...`, naming what to fix and,
where one exists, the nearest valid name. What the command line sets wins
over what its config file set, attention options included: those the
file set for an attention the command line replaced are left out, with a
line that says so.

A command defines its flags, then hands its `main` to `run`.
"""

from collections.abc import Callable, Collection
import glob
import os
import re
import sys
import tempfile
import traceback
from typing import Any, NoReturn

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from train.base.errors import (InputError, Stopped, StoreFailure,
                               TrainingError, did_you_mean)


def fail(message: str, status: int = 2, *, at_once: bool = False
         ) -> NoReturn:
  """Prints each line of `message` as `error: ...` and exits; `at_once`,
  without waiting for other threads or running exit handlers (those of a
  store that does not answer would wait on it for minutes)."""
  for line in message.splitlines() or ['']:
    print(f'error: {line}', file=sys.stderr)
  _exit(status, at_once=at_once)


def _exit(status: int, *, at_once: bool) -> NoReturn:
  if at_once:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # pylint: disable=protected-access
  sys.exit(status)


# Python's and absl's words for a value they could not read, and ours.
_VALUE_WORDING = (
    (r"invalid literal for int\(\) with base 10: .*", 'must be an integer.'),
    (r'could not convert string to float: .*', 'must be a number.'),
    (r"\('Non-boolean argument to boolean flag', .*\)",
     'must be True or False.'),
    # absl's bounds: '0 is not a positive integer', 'is not number >= 1'.
    (r'\S+ is not ((?:an? )?(?:\S+ )?(?:integer|number)\b.*)',
     r'must be \1.'),
)


def _value_error(flag: str, detail: str) -> str:
  """`FLAG=VALUE: what is wrong`, in our words where absl's or Python's
  say it, and VALUE said once where `detail` begins with it too (a config
  file's message naming its argument)."""
  detail = detail.removeprefix(f'{flag.partition("=")[2]}: ')
  for pattern, ours in _VALUE_WORDING:
    if re.fullmatch(pattern, detail):
      return f'{flag}: {re.sub(pattern, ours, detail)}'
  return f'{flag}: {detail}' if detail else flag


def _raised(text: str) -> str:
  """The last line of an error's text (a config file's traceback holds
  it), without the exception's name (`train.base.errors.InputError: `)."""
  return re.sub(r'^[\w.]*(Error|Exception): ', '',
                text.strip().splitlines()[-1])


def _flag_error(error: flags.Error) -> str:
  """absl's message for a flag it refused, on one line."""
  text = str(error)
  unknown = re.match(r"Unknown command line flag '([^']+)'"
                     r"(?:\. Did you mean: ([\w.-]+))?", text)
  if unknown:
    name, near = unknown.groups()
    near = _config_key_flag(name) or (near and f'--{near}')
    return f'unknown flag --{name}' + (f'; did you mean {near}?'
                                       if near else '.')
  required = re.search(r'Flag --(\w+) must have a value other than None',
                       text)
  if required:
    name = required.group(1)
    known = flags.FLAGS[name].help if name in flags.FLAGS else ''
    return f'--{name} is required' + (f': {known}' if known else '.')
  # A config file that raised is reported with its traceback inside the
  # message; the flag and the last line (the error) say it all.
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  flag, _, detail = lines[0].removeprefix('flag ').partition(': ')
  return _value_error(flag, _raised(text) if len(lines) > 1 else detail)


def _config_flags() -> list[str]:
  """The names of the config-file flags that were given."""
  names = []
  for name in list(flags.FLAGS):
    flag = flags.FLAGS[name]
    if (config_flags.config_flags.is_config_flag(flag)
        and flag.value is not None and name == flag.name):
      names.append(name)
  return names


def _config_key_flag(name: str) -> str | None:
  """`--config.NAME` (or `--config.model.NAME`) when NAME, typed as a flag
  of its own, is a key of a config flag's config that holds a value."""
  for flag in _config_flags():
    for key in (name, f'model.{name}'):
      node = flags.FLAGS[flag].value
      try:
        for part in key.split('.'):
          node = node[part]
      except (KeyError, TypeError, OSError):  # OSError: no such file.
        continue
      if not hasattr(node, 'keys'):  # Not a group of keys.
        return f'--{flag}.{key}'
  return None


def _override_error(argv: list[str], error: Exception) -> str:
  """The message for `--config.a.b=...` naming no key of the config."""
  text = str(error)
  key = re.search(r"\\?'(\w+)\\?'", text)
  near = re.search(r'Did you mean "(\w+)"', text)
  if key is None:
    return text
  key = key.group(1)
  for arg in argv:
    name = arg.lstrip('-').split('=', 1)[0]
    path = name.removeprefix('no').split('.')
    if len(path) > 1 and key in path[1:]:
      parent = '.'.join(path[:path.index(key, 1)])
      return (f'{arg}: {parent} has no key {key!r}'
              + (f'; did you mean {near.group(1)}?' if near else '.'))
  return text


def _config_file_error(argv: list[str], name: str, error: Exception) -> str:
  """The message for `--config=PATH` that names no loadable file."""
  given = next((arg.split('=', 1)[1] for arg in argv
                if arg.startswith((f'--{name}=', f'-{name}='))), '')
  path = given.split(':', 1)[0]
  if os.path.isfile(path):  # The file itself failed to load.
    return _value_error(f'--{name}={given}', _raised(str(error)))
  for near in (path + '.py', os.path.join('configs', path),
               os.path.join('configs', path + '.py')):
    if os.path.isfile(near):
      argument = given[len(path):]  # ':...', if any.
      return (f'--{name}={given}: no such file; did you mean '
              f'{near}{argument}?')
  folder = os.path.dirname(path) or '.'
  files = sorted(glob.glob(os.path.join(folder, '*.py')))
  if os.path.dirname(path) == '':
    files = [os.path.basename(f) for f in files]
  return f'--{name}={given}: no such file{did_you_mean(path, files)}'


def drop_attention_options(config, keep: Callable[[str, Any], bool]) -> str:
  """Unsets each option that config.model.attention_options sets
  (`window`, or `local.window` under an attention's name) and
  `keep(key, value)` does not keep; says which, `key=value, ...` ('' for
  none)."""
  options = config.model.get('attention_options')
  if not hasattr(options, 'items'):  # Not a group of keys to unset.
    return ''
  groups = [('', options)] + [(f'{name}.', group)
                              for name, group in options.items()
                              if hasattr(group, 'items')]
  dropped = []
  for prefix, group in groups:
    for option, value in list(group.items()):
      if value is not None and not hasattr(value, 'items') and not keep(
          prefix + option, value):
        group[option] = None
        dropped.append(f'{prefix}{option}={value!r}')
  return ', '.join(dropped)


def _command_line_wins(config, typed: Collection[str], shown: str) -> None:
  """`config`'s attention options as the command line says over its file:
  `typed`, the dotted keys it set. A flat option typed replaces the
  file's under an attention's name, one typed under a name the file's
  flat one; where it typed model.attention, the file's options that the
  new pattern does not read (model.config.option_fits) are left out, in
  a line that names the keys as typed (`shown`: `--config.`)."""
  if 'attention_options' not in config.get('model', {}):
    return
  # Here, not at the top: a command without a model's config (launch)
  # starts without JAX.
  from model.config import option_fits  # pylint: disable=import-outside-toplevel
  group = 'model.attention_options.'
  options = {key.removeprefix(group) for key in typed
             if key.startswith(group)}
  flat = {key for key in options if '.' not in key}
  named = {key.rpartition('.')[2] for key in options if '.' in key}

  def not_replaced(key: str, value: Any) -> bool:
    name, _, option = key.rpartition('.')
    return key in options or option not in (flat if name else named)

  drop_attention_options(config, not_replaced)
  if 'model.attention' not in typed:
    return
  model = config.model
  left_out = drop_attention_options(config, lambda key, value: (
      key in options or option_fits(
          model.attention, key, value,
          dropout=bool(model.get('attention_dropout_rate')))))
  if left_out:
    print(f'config.model.attention_options ({left_out}) left out: the '
          f'config file set these for the attention that {shown}model.'
          f'attention={model.attention!r} replaced.', flush=True)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, config files loaded and the command line's
  keys winning over theirs (_command_line_wins); each mistake is one line
  and exit status 2."""
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as error:
    fail(_flag_error(error))
  except (AttributeError, KeyError) as error:
    fail(_override_error(argv, error))
  for name in _config_flags():
    flag = flags.FLAGS[name]
    try:  # ml_collections defers a file's failure to the first access.
      flag.value.keys()
    except OSError as error:
      fail(_config_file_error(argv, name, error))
    _command_line_wins(flag.value, config_flags.get_override_values(flag),
                       f'--{name}.')
  return rest


def load_config(config_arg: str, overrides: dict[str, Any], *,
                typed: str = '--config.'):
  """The config that `python -m train.train --config=CONFIG_ARG
  --config.KEY=VALUE ...` trains, read the way that command reads it (the
  line of _command_line_wins printed); InputError naming the file, or the
  override as it was typed: `{typed}KEY=VALUE` (a sweep's
  `--set=KEY=VALUE`)."""
  argv = ['train', f'--config={config_arg}',
          *(f'--config.{key}={value}' for key, value in overrides.items())]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'Config file.',
                                  flag_values=values, lock_config=True,
                                  sys_argv=argv)
  try:
    values(argv)
    values.config.keys()
  except flags.Error as error:
    message = _flag_error(error)
  except (AttributeError, KeyError) as error:
    message = _override_error(argv, error)
  except OSError as error:
    message = _config_file_error(argv, 'config', error)
  else:
    _command_line_wins(values.config, overrides, typed)
    return values.config
  raise InputError(message.replace('--config.', typed))


def _failure(error: Exception) -> str:
  """One line for an unexpected error; its traceback printed (--verbose)
  or in a log file that the line names."""
  summary = f'{type(error).__name__}: {error}'.strip().splitlines()[0]
  trace = traceback.format_exc()
  if 'verbose' in flags.FLAGS and flags.FLAGS['verbose'].value:
    print(trace, file=sys.stderr, end='')
    return summary
  with tempfile.NamedTemporaryFile('w', prefix='attnlab-error-',
                                   suffix='.log', delete=False) as log:
    log.write(' '.join(sys.argv) + '\n\n' + trace)
  return f'{summary} (traceback in {log.name}; --verbose prints it)'


def outcome(work: Callable[[], Any]) -> Any:
  """work(), its errors turned into the exit statuses above."""
  try:
    return work()
  except InputError as error:
    fail(str(error))
  except StoreFailure as error:
    fail(str(error), status=1, at_once=True)
  except TrainingError as error:
    fail(str(error), status=1)
  except Stopped as stopped:
    _exit(0, at_once=stopped.at_once)
  except KeyboardInterrupt:  # A command with no handler of its own.
    print('Interrupted.', file=sys.stderr)
    sys.exit(130)
  except Exception as error:  # pylint: disable=broad-except
    fail(_failure(error), status=1)


def run_main(argv: list[str], work: Callable[[], Any]) -> Any:
  """The body of a command's main: no stray arguments, library logs at
  WARNING unless --verbosity is given (every checkpoint write would drown
  the progress), then `outcome(work)`."""
  if len(argv) > 1:
    fail(f'unexpected arguments: {" ".join(argv[1:])}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  return outcome(work)


def run(main: Callable[[list[str]], Any],
        define_flags: Callable[[], None] = lambda: None) -> None:
  """Defines a command's flags and runs its `main(argv)` (which calls
  run_main) with this module's flag parsing and --verbose."""
  try:  # A config dict flag reads its overrides as it is defined.
    define_flags()
  except (AttributeError, KeyError) as error:
    fail(_override_error(sys.argv, error))
  if 'verbose' not in flags.FLAGS:
    flags.DEFINE_boolean('verbose', False, 'When the run fails, print the '
                         'traceback rather than write it to a log file.')
  app.run(main, flags_parser=parse_flags)
