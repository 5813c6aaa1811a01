"""`python -m train.train`, interrupted on cue: for the reliability tests.

  python tests/helpers/interrupted_train.py --interrupt=HOW:STEP \
      [train.train flags]

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
or `none` (no interruption). The cues hook the loop's per-step call
(StopRequest.due), the checkpointer and orbax's commit (the atomic
rename). The lock of a workdir on an object store is leased for
LEASE_S seconds, not a minute, so that the run after a killed one waits
that long. Nothing else changes.
"""

import os
import signal
import sys
import time

from absl import app
from orbax.checkpoint._src.path import atomicity

from train import cli, train
from train.run import checkpointing, preemption, workdir

# Seconds each step takes after a SIGTERM cue.
SLOWED_STEP_S = 0.2
LEASE_S = 2.0


def _cue(interrupt: str) -> None:
  workdir.LEASE_S = LEASE_S
  if interrupt == 'none':
    return
  how, step = interrupt.split(':')
  step = int(step)
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
    if how == 'term' and done >= step:
      time.sleep(SLOWED_STEP_S)
    return due(self, done)

  preemption.StopRequest.due = signalled_after


if __name__ == '__main__':
  flag = next(arg for arg in sys.argv if arg.startswith('--interrupt='))
  sys.argv.remove(flag)
  _cue(flag.split('=', 1)[1])
  app.run(train.main, flags_parser=cli.parse_flags)
