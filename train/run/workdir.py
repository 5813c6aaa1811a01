"""A workdir belongs to one run and one config.

One run at a time: the run takes `workdir/lock` when it starts (on several
hosts, process 0 on the shared workdir) and leaves it when it ends; the
lock names its holder's host and pid. A second run on a locked workdir
stops, naming the holder; a killed run's lock is taken over with a warning.
On a disk the lock is an advisory file lock, which the kernel lets go of
when its holder dies, so the second run stops at once. An object store
(gs://...) has no such lock: there the lock is a lease (`LeaseLock`), which
a run that finds it watches for up to LEASE_S seconds; its holder writes
the workdir only while it knows the lease holds, and stops before its next
write once it lapsed or another run took it over.

One config: `config.json` is written when the workdir holds no record of a
run yet (RECORDS: no metrics, no checkpoint, no history), and never
rewritten after; a workdir with a record but no config.json is refused
(nothing would check its resume). A resume is compared with it, key by
key, as later resumes changed it (each change is a line of
`config_history.jsonl`): only the keys of RESUMABLE, which say
how the run is observed, stopped or laid out on the devices, may change;
the run's number of steps may change only under a schedule that does not
depend on it. Any other difference stops the run before anything is
written, listing each key with its old and new values.
"""

from collections.abc import Callable, Iterator
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
from train.base.errors import InputError, Stopped
from train.program import optim
from train.run import portable

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


# What records a run in its workdir, once it holds anything: a start
# killed before its first step leaves an empty checkpoints/ and
# metrics.jsonl, which bind nothing.
RECORDS = ('checkpoints', 'metrics.jsonl', 'config_history.jsonl')


def run_record(workdir: str) -> list[str]:
  """Those of RECORDS that hold anything in `workdir`."""
  def holds(path) -> bool:
    return (any(path.iterdir()) if path.is_dir()
            else path.exists() and path.stat().length > 0)
  return [name for name in RECORDS if holds(storage.path(workdir) / name)]


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
                     "workdir's config: restore it from a copy, or use "
                     'another workdir.') from None
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


def same_config(old_json: str, new_json: str) -> bool:
  """Whether two configs' JSON (to_json_best_effort) say one run: no
  `differences`, so that a key added since (an option of a variant
  registered since) left at its default is the same config."""
  return not differences(_flat(json.loads(old_json)),
                         _flat(json.loads(new_json)))


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
# The part of a lease its holder does not count on: room for a request
# sent at the end of what it counts to reach the store in time.
UNCOUNTED = 0.1


class LeaseLost(Stopped):
  """This run's lease of its workdir lapsed (it could not renew it for
  LEASE_S seconds: a stall, a partition) or another run took it over; the
  message says which in one line. The run stops without writing again,
  and entry points exit with status 0, as for a stop, at once: the
  threads of the store's libraries may still wait on it, and another run
  may own the workdir."""

  at_once = True


def _parsed(text: str) -> Any:
  """A lock's record; {} when the lock is empty (as a disk lock's release
  leaves it, seen through a mount)."""
  try:
    return json.loads(text) if text.strip() else {}
  except ValueError:
    return {'unreadable': text[:80]}


class LeaseLock:
  """`workdir/lock` on an object store: an object naming its holder, which
  a thread of the holder rewrites every LEASE_S / 4 seconds (counting its
  `renewals`) until `release` deletes it.

  A run that finds the lock watches it for LEASE_S seconds of its own
  clock: renewed, it is a live run's, and this run stops naming it (within
  about LEASE_S / 4 seconds); deleted, it was released; unchanged all that
  time, it is a killed run's, which this run deletes. It then creates the
  lock only if no lock exists, so of two runs that start at once one
  stops. A run resumed after a kill so waits LEASE_S seconds first; one
  resumed after a stop (SIGTERM, a preemption notice), which releases the
  lock, does not wait.

  Every write and deletion of the lock holds only for the version of it
  read or written last (its generation, a precondition the store checks):
  a run deletes the expired lock it watched, never one another run has
  just created; a renewal fails where another run has taken the lock
  over. And the holder knows how long its lease lasts: a run taking it
  over watches it unrenewed for LEASE_S from after the start of the last
  renewal the store confirmed. It counts that time less UNCOUNTED of it
  (`seconds_left`), and every operation of the workdir through
  storage.bounded (metrics, evaluations' outputs, checkpoints, the lock's
  own renewals) is started only while some of it is left and waited for
  no longer (storage.lease): past it, or once a renewal was refused, the
  run stops before its next write (LeaseLost).
  """

  def __init__(self, workdir: str):
    self._workdir = storage.resolve(workdir)
    self._object = storage.path(workdir) / 'lock'
    self._path = str(self._object)
    found = storage.read_versioned(self._object)
    if found is not None and _parsed(found[0]):
      found = self._watch(found)
    if found is not None:  # An expired lock, or an empty one.
      storage.delete_if(self._object, found[1])
    self._record = _holder_record() | {'token': uuid.uuid4().hex,
                                       'renewals': 0}
    # The start of the last write of the lock the store confirmed.
    self._confirmed = time.monotonic()
    self._generation = self._write('0')
    if self._generation is None:
      raise _in_use(self._path, _described(self._holder()) or 'another run')
    self._taken_by = None  # Who has the lock, once a renewal failed.
    # When renewals began to fail (None: the last one was confirmed).
    self._failing_since = None
    self._writing = threading.Lock()
    self._released = threading.Event()
    storage.lease(self._workdir, self.seconds_left)
    self._renewing = threading.Thread(target=self._renew, daemon=True,
                                      name='workdir lock')
    self._renewing.start()

  def _text(self) -> str:
    return json.dumps(self._record) + '\n'

  def _write(self, generation: str) -> str | None:
    """Writes this run's record over the lock's version `generation` ('0':
    over none); the version written, or None where another is there. A
    write of this run's own that landed unseen (its answer lost and the
    upload retried, or one finished after its time bound) is known by its
    token, and taken as written."""
    written = storage.write_if(self._object, self._text(), generation)
    if written is not None:
      return written
    found = storage.read_versioned(self._object)
    if (found is not None
        and _parsed(found[0]).get('token') == self._record['token']):
      return found[1]
    return None

  def _holder(self) -> Any:
    """The record of the lock there now (None: there is none)."""
    found = storage.read_versioned(self._object)
    return None if found is None else _parsed(found[0])

  def _watch(self, found: tuple[str, str]) -> tuple[str, str] | None:
    """What is left of the lock `found` (text, generation) once it is
    released (None, or an empty lock) or expires (`found`, with a
    warning); InputError once it is renewed."""
    holder = _described(_parsed(found[0]))
    print(f'{self._path} is held by {holder}; watching it for up to '
          f'{LEASE_S:g} s to see whether that run is alive.', flush=True)
    deadline = time.monotonic() + LEASE_S
    while time.monotonic() < deadline:
      time.sleep(min(LEASE_S / 8, max(deadline - time.monotonic(), 0)))
      now = storage.read_versioned(self._object)
      if now is None or not _parsed(now[0]):
        return now
      if now[1] != found[1]:
        raise _in_use(self._path, _described(_parsed(now[0])))
    print(f'warning: taking over {self._path} from {holder}, which has not '
          f'renewed it for {LEASE_S:g} s (a run that was killed).',
          flush=True)
    return found

  def _left(self) -> float:
    return (self._confirmed + LEASE_S * (1 - UNCOUNTED)
            - time.monotonic())

  def seconds_left(self) -> float:
    """Seconds this run's lease is known to last yet (see the class);
    LeaseLost once none are, or once another run took the lock over."""
    left = self._left()
    if self._taken_by is not None:
      raise LeaseLost(
          f'{self._path} was taken over by {self._taken_by}: this run '
          f'could not renew it for {LEASE_S:g} s (stalled, or cut off from '
          'the store), and stopped without writing the workdir again; that '
          'run now owns it.')
    if left <= 0:
      raise LeaseLost(
          f'{self._path} could not be renewed for {LEASE_S:g} s (this run '
          'stalled, or was cut off from the store), so another run may own '
          'the workdir now: this run stopped without writing the workdir '
          'again; run the same command to resume.')
    return left

  def renew(self) -> None:
    """Rewrites the lock if it is still as this run last wrote it;
    LeaseLost if another run has taken it over (or deleted it), or once
    the lease has lapsed. An error of the store is said once, until a
    renewal is confirmed again (said too), and tried again at the next
    renewal."""
    with self._writing:
      if self._taken_by is None:
        self._record['renewals'] += 1
        started = time.monotonic()
        try:
          generation = self._write(self._generation)
        except LeaseLost:
          raise
        # Any error of the store (gcsfs's are not all OSErrors).
        except Exception as error:  # pylint: disable=broad-except
          if self._failing_since is None:
            self._failing_since = started
            print(f'warning: could not renew {self._path} '
                  f'({storage.reason(error)}); trying again every '
                  f'{LEASE_S / 4:g} s. Unless the store answers within '
                  f'{max(self._left(), 0):.0f} s, the run stops before its '
                  'next write of the workdir.', flush=True)
        else:
          if generation is None:
            self._taken_by = (_described(self._holder())
                              or 'a run that deleted it')
          else:
            self._generation, self._confirmed = generation, started
            if self._failing_since is not None:
              print(f'{self._path} renewed again, '
                    f'{started - self._failing_since:.0f} s after its '
                    'renewals began to fail.', flush=True)
              self._failing_since = None
    self.seconds_left()

  def _renew(self) -> None:
    with contextlib.suppress(LeaseLost):  # Said by `check`, before a write.
      while not self._released.wait(LEASE_S / 4):
        self.renew()

  def check(self, *, confirm: bool = False) -> None:
    """Before a write of the workdir: LeaseLost unless this run's lease is
    known to last (`seconds_left`). Told to `confirm` (before a
    checkpoint), renews it first, for a whole lease."""
    if confirm:
      self.renew()
    else:
      self.seconds_left()

  def release(self) -> None:
    """Stops renewing the lock and deletes it, if it is still this run's
    and its lease lasts; a failure is said, not raised (the next run takes
    it over)."""
    self._released.set()
    self._renewing.join(timeout=LEASE_S / 4)
    try:
      with self._writing:
        storage.delete_if(self._object, self._generation)
    except LeaseLost:  # Said by the run it stopped.
      pass
    except Exception as error:  # pylint: disable=broad-except
      print(f'warning: could not release {self._path} '
            f'({storage.reason(error)}); the next run takes it over after '
            f'{LEASE_S:g} s.', flush=True)
    finally:
      storage.lease(self._workdir, None)


def claim(config: ml_collections.ConfigDict, workdir: str
          ) -> contextlib.AbstractContextManager:
  """Makes `workdir` this run's: creates it, takes its lock, and writes
  config.json (a new workdir) or checks the resume against it and records
  the allowed changes. Every host checks it can write there. Returns a
  context that holds the lock and gives `check(confirm=False)`, to call
  before each write of the workdir (LeaseLost once another run has taken
  the lock over, or the lease lapsed); InputError before anything is
  written if the workdir cannot be written, is locked, holds another
  config, or holds a run without its config.json. A workdir it made is
  removed again where the start is refused, then or later in the context
  (InputError), before the run recorded anything there."""
  problem, lock, made = None, None, False
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
    # Made by this run: a start refused before it records anything
    # removes it (`_holding`).
    made = not directory.exists()
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
      _remove_unrecorded(workdir, made)
      lock.release()
    raise InputError(problem or f'--workdir={workdir} was refused by '
                     'another host (see its output).')
  return _holding(lock, workdir, made)


def _unleased(*, confirm: bool = False) -> None:
  """The check before a write where no lease can be lost: a disk's lock,
  the kernel's, held until released."""
  del confirm


def _leased(lock: LeaseLock | None) -> Callable[..., None]:
  """The check before a write on an object store, on every host (`lock`:
  process 0's; None on the others): LeaseLost on all of them once process
  0 finds the lock taken over, so that none goes on to a collective the
  others have left."""
  def check(*, confirm: bool = False) -> None:
    lost = None
    if lock is not None:
      try:
        lock.check(confirm=confirm)
      except LeaseLost as error:
        lost = error
    if not hosts.minimum_over_hosts(lost is None):
      raise lost or LeaseLost('process 0 found this workdir taken over by '
                              'another run; stopped without writing again.')
  return check


def _remove_unrecorded(workdir: str, made: bool) -> None:
  """Removes `workdir` if this run `made` it and it holds no record of a
  run (RECORDS): what a refused start wrote there (config.json, the lock,
  an empty checkpoints/) is no use to the next, and would name a config
  nothing trained. Called by the lock's holder while it holds it, so that
  no other run's start is removed."""
  if made and not run_record(workdir):
    storage.path(workdir).rmtree(missing_ok=True)


@contextlib.contextmanager
def _holding(lock: Lock | LeaseLock | None, workdir: str, made: bool
             ) -> Iterator[Callable[..., None]]:
  """Holds `lock` (None on the hosts other than process 0) until the
  context ends, giving the check to make before each write of the workdir
  (`_leased` on an object store). A start refused (InputError) before it
  recorded anything in a workdir it `made` leaves nothing there."""
  try:
    yield (_leased(lock) if storage.is_object_store(workdir)
           else _unleased)
  except InputError:
    if lock is not None:
      _remove_unrecorded(workdir, made)
    raise
  finally:
    if lock is not None:
      lock.release()


def _record_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """config.json of a workdir without a record of a run; else the resume
  checked and its changes appended to config_history.jsonl; either way of
  the config as the workdir keeps it (portable.recorded: its tokenizer
  copied in). InputError, before anything is written, for a record
  without its config.json."""
  path = storage.path(workdir) / 'config.json'
  history = storage.path(workdir) / 'config_history.jsonl'
  record = run_record(workdir)
  if record and not path.exists():
    raise InputError(
        f'--workdir={workdir} holds a run ({", ".join(record)}) but not its '
        'config.json, which a resume is checked against: restore '
        f'{path} from a copy to resume it, or give this run another '
        '--workdir.')
  config = portable.recorded(config, workdir, new=not record)
  if not record:
    storage.write_whole(path, _as_json(config))
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
