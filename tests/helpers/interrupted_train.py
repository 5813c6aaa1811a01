"""`python -m train.train`, interrupted on cue: for the reliability tests.

  python tests/helpers/interrupted_train.py --interrupt=HOW:STEP \
      [--lease_s=SECONDS] [train.train flags]

HOW is one of
  kill:  SIGKILL this process once step STEP is dispatched (with several
         steps a call, the call that holds it) and the checkpoint saved
         before it is written (so that where the run resumes does not
         depend on how fast the disk is);
  save:  SIGKILL it while it writes the checkpoint of step STEP, after the
         arrays are written and before orbax renames the directory to
         commit it;
  term:  send it SIGTERM once step STEP is dispatched (a preemption), and
         slow every later step down, so that on several hosts the notice
         reaches them all (through JAX's coordination service) before the
         run ends;
  stall: SIGSTOP it where `kill` would kill it (a stall, a partition),
         for whoever waits on it to send SIGCONT;
  partition: from its first upload of metrics.jsonl once step STEP is
         dispatched (the one before a checkpoint of STEP, right after the
         lease was confirmed), hold every request its gcsfs makes (its
         files, orbax's metadata, the lock's renewals), as a network cut
         off from the store holds them, until SIGUSR1 heals it: each then
         goes on. One cancelled while held is never sent. Says
         `partitioned` on stdout as it begins;
or `none` (no interruption). The cues hook the loop's per-step call
(StopRequest.due), the checkpointer, orbax's commit (the atomic rename)
and gcsfs's requests. The lock of a workdir on an object store is leased
for LEASE_S seconds (or --lease_s), not a minute, so that the run after a
killed one waits that long. Nothing else changes.
"""

import asyncio
import os
import signal
import sys
import threading
import time

from absl import app
import gcsfs
from orbax.checkpoint._src.path import atomicity

from train import cli, train
from train.run import checkpointing, preemption, workdir

# Seconds each step takes after a SIGTERM cue.
SLOWED_STEP_S = 0.2
# The lease of its workdir's lock on an object store: renewed every 1.25 s,
# room for a renewal on cores shared with a compile and the store itself
# (at 2 s, runs on shared cores lost theirs: the run must renew within
# 0.9 of a lease to go on writing).
LEASE_S = 5.0


def _partition(cut_off: threading.Event) -> None:
  """Holds gcsfs's requests from the first upload of metrics.jsonl once
  `cut_off` is set, until SIGUSR1."""
  healed, holding = threading.Event(), threading.Event()
  signal.signal(signal.SIGUSR1, lambda *_: healed.set())
  request = gcsfs.GCSFileSystem._request

  async def held(self, *args, **kwargs):
    if (cut_off.is_set() and not holding.is_set()
        and 'metrics.jsonl' in repr((args, kwargs))):
      holding.set()
      print('partitioned', flush=True)
    while holding.is_set() and not healed.is_set():
      await asyncio.sleep(0.05)
    return await request(self, *args, **kwargs)

  gcsfs.GCSFileSystem._request = held


def _cue(interrupt: str, lease_s: float) -> None:
  workdir.LEASE_S = lease_s
  if interrupt == 'none':
    return
  how, step = interrupt.split(':')
  step = int(step)
  cut_off = threading.Event()
  if how == 'partition':
    _partition(cut_off)
  if how == 'save':
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def killed_before_commit(self, *args, **kwargs):
      if self.get_final().name == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
      return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = killed_before_commit
    return

  checkpointers = []
  save = checkpointing.Checkpointer.save

  def remembered_save(self, *args, **kwargs):
    checkpointers.append(self)
    return save(self, *args, **kwargs)

  checkpointing.Checkpointer.save = remembered_save
  due = preemption.StopRequest.due

  fired = []

  def signalled_after(self, done: int) -> bool:
    # With several steps a call, the call that reaches STEP.
    cued = done >= step and not fired
    if cued:
      fired.append(done)
    if cued and how in ('kill', 'stall'):
      for checkpointer in checkpointers[-1:]:
        checkpointer.wait()
      os.kill(os.getpid(), signal.SIGKILL if how == 'kill'
              else signal.SIGSTOP)
    if cued and how == 'term':
      os.kill(os.getpid(), signal.SIGTERM)
    if cued and how == 'partition':
      cut_off.set()
    if how == 'term' and done >= step:
      time.sleep(SLOWED_STEP_S)
    return due(self, done)

  preemption.StopRequest.due = signalled_after


def _flag(name: str, default: str) -> str:
  """The value of --NAME=, taken out of the command line."""
  for arg in sys.argv:
    if arg.startswith(f'--{name}='):
      sys.argv.remove(arg)
      return arg.split('=', 1)[1]
  return default


if __name__ == '__main__':
  _cue(_flag('interrupt', 'none'), float(_flag('lease_s', str(LEASE_S))))
  app.run(train.main, flags_parser=cli.parse_flags)
