"""A workdir belongs to one run and one config.

One run at a time: the run takes `workdir/lock` when it starts (on several
hosts, process 0 on the shared workdir) and leaves it when it ends; the
lock names its holder's host and pid. A second run on a locked workdir
stops, naming the holder; a killed run's lock is taken over with a warning.
On a disk the lock is an advisory file lock, which the kernel lets go of
when its holder dies, so the second run stops at once. An object store
(gs://...) has no such lock: there the lock is a lease (`LeaseLock`), which
a run that finds it watches for up to LEASE_S seconds.

One config: `config.json` is written when the workdir holds no record of a
run yet (no metrics, no checkpoint), and never rewritten after. A resume is
compared with it, key by key, as later resumes changed it (each change is
a line of `config_history.jsonl`): only the keys of RESUMABLE, which say
how the run is observed, stopped or laid out on the devices, may change;
the run's number of steps may change only under a schedule that does not
depend on it. Any other difference stops the run before anything is
written, listing each key with its old and new values.
"""

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import time
from typing import Any
import uuid

import dataclasses
import functools

import jax
import ml_collections

from model.config import ModelConfig
from train.base import hosts, storage, train_config
from train.base.errors import InputError
from train.program import optim

# Keys (or dotted prefixes) a resume may change: logging, evaluation,
# checkpoints, the closing sample, what stops a run, where the data lives,
# and the layout on the devices (a checkpoint resumes on any mesh; micro-
# batches and rematerialisation compute the same update).
RESUMABLE = (
    'log_every', 'eval_every', 'checkpoint_every', 'keep_checkpoints',
    'eval_split', 'num_eval_steps', 'decode_splits', 'num_decode_examples',
    'beam_size', 'beam_alpha', 'sample_length', 'sample_prompt',
    'sample_temperature', 'nan_policy', 'max_skipped_steps',
    'debug_poison_step', 'data_dir', 'parallelism', 'logical_axis_rules',
    'distributed', 'grad_accum_steps', 'steps_per_call', 'model.remat',
    'model.scan_layers')
# Schedules whose learning rate at a step does not depend on
# num_train_steps: a run on them may be extended or shortened.
_ABSENT = '(absent)'


def _flat(tree: Any, prefix: str = '') -> dict[str, Any]:
  """{'model.d_model': 128, ...} of a config's JSON."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  flat = {}
  for key, value in tree.items():
    flat |= _flat(value, f'{prefix}{key}' if not prefix
                  else f'{prefix}.{key}')
  return flat


def _as_json(config: ml_collections.ConfigDict) -> str:
  return config.to_json_best_effort(indent=2, sort_keys=True) + '\n'


def _resumable(key: str) -> bool:
  return any(key == name or key.startswith(name + '.') for name in RESUMABLE)


def _has_record(workdir: str) -> bool:
  """Whether a run has left metrics or checkpoints in `workdir`."""
  metrics = storage.path(workdir) / 'metrics.jsonl'
  checkpoints = storage.path(workdir) / 'checkpoints'
  return ((metrics.exists() and metrics.stat().length > 0)
          or (checkpoints.is_dir() and any(checkpoints.iterdir())))


def run_config(workdir: str) -> dict[str, Any]:
  """The config the run in `workdir` follows, as JSON: config.json, with
  the changes of config_history.jsonl applied in order. InputError naming
  the file that cannot be read."""
  path = storage.path(workdir) / 'config.json'
  try:
    config = json.loads(path.read_text())
    path = storage.path(workdir) / 'config_history.jsonl'
    changes = []
    if path.exists():
      changes = [json.loads(line)['changes']
                 for line in path.read_text().splitlines() if line.strip()]
    for change in changes:
      for key, (_, new) in change.items():
        *parents, name = key.split('.')
        node = config
        for parent in parents:
          node = node.setdefault(parent, {})
        node[name] = new
  except (OSError, ValueError, KeyError, TypeError) as error:
    raise InputError(f'{path} cannot be read ({error}); it records this '
                     "workdir's config.") from None
  return config


def recorded_config(workdir: str) -> dict[str, Any]:
  """`run_config`, flat: {'model.d_model': 128, ...}."""
  return _flat(run_config(workdir))


@functools.cache
def _defaults() -> dict[str, Any]:
  """Each key's default, flat: the training keys' and config.model's
  fields' (those with a plain default)."""
  model = {f'model.{field.name}': field.default
           for field in dataclasses.fields(ModelConfig)
           if field.default is not dataclasses.MISSING}
  return _flat(train_config.defaults().to_dict()) | model


def differences(old: dict[str, Any], new: dict[str, Any]
                ) -> dict[str, tuple[Any, Any]]:
  """{key: (old value, new value)} of the keys whose values differ. A key
  absent from the old config (added since) holds its default there, and
  one with no default (an attention option) None; a key absent from the
  new config is None there. So a key added since and left at its default
  is no change."""
  defaults = _defaults()
  before = lambda key: old[key] if key in old else defaults.get(key)
  return {key: (old.get(key, _ABSENT), new.get(key, _ABSENT))
          for key in sorted(old.keys() | new.keys())
          if before(key) != new.get(key)}


def check_resume(old: dict[str, Any], new: dict[str, Any],
                 workdir: str = 'this workdir'
                 ) -> dict[str, tuple[Any, Any]]:
  """The changes of a resume from `old` to `new` (flat configs), all
  allowed; InputError listing those that are not."""
  changes = differences(old, new)
  refused = {key: values for key, values in changes.items()
             if not _resumable(key) and key != 'num_train_steps'}
  lines = [f'config.{key}: {old_value!r} -> {new_value!r}'
           for key, (old_value, new_value) in refused.items()]
  if ('num_train_steps' in changes
      and new.get('schedule') not in optim.length_free_schedules()):
    old_steps, new_steps = changes['num_train_steps']
    lines.append(
        f'config.num_train_steps: {old_steps!r} -> {new_steps!r} would '
        f'change the {new.get("schedule")} schedule this run has followed '
        '(its decay ends at num_train_steps); only '
        f'{" and ".join(optim.length_free_schedules())} schedules can be '
        'extended or shortened')
  if lines:
    raise InputError(
        f'{workdir} holds a run of another config (its config.json); a '
        'resume may change only how the run is observed, stopped or laid '
        'out. Differing: ' + '; '.join(lines)
        + '. Use a new --workdir for a new config.')
  return changes


def _holder_record() -> dict[str, Any]:
  """What a lock says of the run holding it."""
  return {'host': socket.gethostname(), 'pid': os.getpid(),
          'since': datetime.datetime.now().isoformat(timespec='seconds')}


def _described(holder: Any) -> str:
  """Who a lock's record names ('' if no one)."""
  if not holder:
    return ''
  try:
    return (f'the run of pid {holder["pid"]} on {holder["host"]} (since '
            f'{holder["since"]})')
  except (KeyError, TypeError):
    return 'an unknown run'


def _in_use(lock: str, holder: str) -> InputError:
  return InputError(
      f'{os.path.dirname(lock)} is in use by {holder} (its {lock}); one run '
      'per workdir: wait for that run to end, or give this one another '
      '--workdir.')


class Lock:
  """`workdir/lock` on a disk, held by this process until `release`. On a
  file system without flock (some Lustre and FUSE mounts) the run goes on
  unlocked, with a warning."""

  def __init__(self, workdir: str):
    self._path = os.path.join(workdir, 'lock')
    self._file = open(self._path, 'a+')
    try:
      fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = self._holder() or 'another run'
      self._file.close()
      raise _in_use(self._path, holder) from None
    except OSError as error:
      if error.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
        raise
      print(f'warning: {self._path} cannot be locked on this file system '
            f'({error.strerror}); nothing stops a second run on this '
            'workdir.', flush=True)
    previous = self._holder()
    if previous:
      print(f'warning: taking over {self._path} from {previous}, which no '
            'longer holds it (a run that was killed).', flush=True)
    self._file.seek(0)
    self._file.truncate()
    self._file.write(json.dumps(_holder_record()) + '\n')
    self._file.flush()

  def _holder(self) -> str:
    """Who the lock file names ('' if no one)."""
    self._file.seek(0)
    try:
      return _described(json.loads(self._file.read() or 'null'))
    except ValueError:
      return 'an unknown run'

  def release(self) -> None:
    """Empties the lock file and lets go of it."""
    self._file.seek(0)
    self._file.truncate()
    self._file.close()


# Seconds an object-store lock stays its holder's without being renewed;
# the holder renews it four times in that time.
LEASE_S = 60.0


class LeaseLock:
  """`workdir/lock` on an object store: an object naming its holder, which
  a thread of the holder rewrites every LEASE_S / 4 seconds (counting its
  `renewals`) until `release` deletes it.

  A run that finds the lock watches it for LEASE_S seconds of its own
  clock: renewed, it is a live run's, and this run stops naming it (within
  about LEASE_S / 4 seconds); deleted, it was released; unchanged all that
  time, it is a killed run's, which this run deletes. It then creates the
  lock only if no lock exists (a precondition the store checks), so of two
  runs that start at once one stops. A run resumed after a kill so waits
  LEASE_S seconds first; one resumed after a stop (SIGTERM, a preemption
  notice), which releases the lock, does not wait.

  Renewals overwrite the lock. A holder that finds another run's lock
  there (its own was deemed expired: it could not renew it for LEASE_S
  seconds) says so and stops renewing; both runs then write the workdir.
  """

  def __init__(self, workdir: str):
    self._object = storage.path(workdir) / 'lock'
    self._path = str(self._object)
    found = self._read()
    left = self._watch(found) if found else found
    if left is not None:  # An expired lock, or an empty one.
      self._object.unlink(missing_ok=True)
    self._record = _holder_record() | {'token': uuid.uuid4().hex,
                                       'renewals': 0}
    if not storage.create(self._object, json.dumps(self._record) + '\n'):
      raise _in_use(self._path, _described(self._read()) or 'another run')
    self._released = threading.Event()
    self._renewing = threading.Thread(target=self._renew, daemon=True,
                                      name='workdir lock')
    self._renewing.start()

  def _read(self) -> Any:
    """The lock's record; None when there is no lock, {} when it is empty
    (as a disk lock's release leaves it, seen through a mount)."""
    try:
      text = self._object.read_text()
    except FileNotFoundError:
      return None
    try:
      return json.loads(text) if text.strip() else {}
    except ValueError:
      return {'unreadable': text[:80]}

  def _watch(self, found: Any) -> Any:
    """What is left once the lock `found` is released (None, or {}) or
    expires (`found`, with a warning); InputError once it is renewed."""
    print(f'{self._path} is held by {_described(found)}; watching it for up '
          f'to {LEASE_S:g} s to see whether that run is alive.', flush=True)
    deadline = time.monotonic() + LEASE_S
    while time.monotonic() < deadline:
      time.sleep(min(LEASE_S / 8, max(deadline - time.monotonic(), 0)))
      now = self._read()
      if not now:
        return now
      if now != found:
        raise _in_use(self._path, _described(now))
    print(f'warning: taking over {self._path} from {_described(found)}, '
          f'which has not renewed it for {LEASE_S:g} s (a run that was '
          'killed).', flush=True)
    return found

  def _another(self) -> Any:
    """Another run's record, if the lock holds one (None: it is this
    run's, or gone)."""
    current = self._read()
    if not current or current.get('token') == self._record['token']:
      return None
    return current

  def _renew(self) -> None:
    while not self._released.wait(LEASE_S / 4):
      # Any error of the store (gcsfs's are not all OSErrors): tried again
      # at the next renewal, the thread alive.
      try:
        another = self._another()
        if another is not None:
          print(f'warning: {self._path} was taken over by '
                f'{_described(another)}; this run no longer renews it, and '
                'two runs now write this workdir.', flush=True)
          return
        self._record['renewals'] += 1
        storage.write_whole(self._object, json.dumps(self._record) + '\n')
      except Exception as error:  # pylint: disable=broad-except
        print(f'warning: could not renew {self._path} ({error}).',
              flush=True)

  def release(self) -> None:
    """Stops renewing the lock and deletes it, if it is still this run's;
    a failure is said, not raised (the next run takes the lock over)."""
    self._released.set()
    self._renewing.join(timeout=LEASE_S / 4)
    try:
      if self._another() is None:
        self._object.unlink(missing_ok=True)
    except Exception as error:  # pylint: disable=broad-except
      print(f'warning: could not release {self._path} ({error}); the next '
            f'run takes it over after {LEASE_S:g} s.', flush=True)


def claim(config: ml_collections.ConfigDict, workdir: str
          ) -> contextlib.AbstractContextManager:
  """Makes `workdir` this run's: creates it, takes its lock, and writes
  config.json (a new workdir) or checks the resume against it and records
  the allowed changes. Every host checks it can write there. Returns a
  context that holds the lock; InputError before anything is written if
  the workdir cannot be written, is locked, or holds another config."""
  problem, lock = None, None
  workdir = storage.resolve(workdir)
  try:
    if storage.unsupported(workdir):
      raise InputError(f'--workdir={workdir}: '
                       f'{storage.unsupported(workdir)}.')
    directory = storage.path(workdir)
    if (storage.is_object_store(workdir)
        and not storage.path(storage.bucket(workdir)).exists()):
      raise InputError(
          f'--workdir={workdir}: the bucket {storage.bucket(workdir)} does '
          'not exist, or these credentials cannot see it.')
    directory.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
      lock = (LeaseLock if storage.is_object_store(workdir) else Lock)(
          workdir)
      _record_config(config, workdir)
    else:  # The others only try.
      probe = directory / f'.written_by_host_{jax.process_index()}'
      probe.write_text('')
      probe.unlink()
  except InputError as error:
    problem = str(error)
  except OSError as error:
    problem = (f'--workdir={workdir} cannot be written: '
               f'{error.strerror or error}.')
  except Exception as error:  # Said on every host, not raised on one.
    problem = f'--workdir={workdir}: {error!r}'
  if not hosts.minimum_over_hosts(problem is None):
    if lock is not None:
      lock.release()
    raise InputError(problem or f'--workdir={workdir} was refused by '
                     'another host (see its output).')
  stack = contextlib.ExitStack()
  if lock is not None:
    stack.callback(lock.release)
  return stack


def _record_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """config.json of a new workdir; else the resume checked and its changes
  appended to config_history.jsonl."""
  path = storage.path(workdir) / 'config.json'
  history = storage.path(workdir) / 'config_history.jsonl'
  if not path.exists() or not _has_record(workdir):
    storage.write_whole(path, _as_json(config))
    if history.exists():
      history.unlink()
    return
  changes = check_resume(recorded_config(workdir),
                         _flat(json.loads(_as_json(config))),
                         f'--workdir={workdir}')
  if not changes:
    return
  lines = storage.Lines(str(history))
  try:
    lines.write(json.dumps({
        'time': datetime.datetime.now().isoformat(timespec='seconds'),
        'changes': {key: list(values) for key, values in changes.items()}})
                + '\n')
  finally:
    lines.close()
  listed = '; '.join(f'config.{key}: {old!r} -> {new!r}'
                     for key, (old, new) in changes.items())
  print(f'Resuming with {listed} (recorded in {history}).', flush=True)
