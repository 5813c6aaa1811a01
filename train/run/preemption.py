"""Stop requests: a signal or a preemption notice, acted on between steps.

A scheduler that preempts a job sends SIGTERM and waits a grace period; a
person at the terminal presses Ctrl-C (SIGINT). Either sets a flag, and the
training loop, at the next step boundary, saves a checkpoint, waits for it
to be written and exits with status 0; running the same command resumes.

With several processes, every host must save the same step. There JAX's
preemption service (started by `jax.distributed.initialize`) owns SIGTERM:
when any host receives it, the hosts agree on a step, and orbax's
`reached_preemption(step)` turns True on all of them at that step. SIGINT
is then left alone (Ctrl-C stops one host without a save).
"""

import signal
import threading

import jax
import orbax.checkpoint as ocp


class StopRequest:
  """Listens for stop signals until `close()`; `due(step)` says whether the
  loop should save and stop after `step`."""

  def __init__(self):
    self._received = None
    self._previous = {}
    self._multihost = jax.process_count() > 1
    # Python runs signal handlers in the main thread only.
    if (not self._multihost
        and threading.current_thread() is threading.main_thread()):
      for signum in (signal.SIGTERM, signal.SIGINT):
        self._previous[signum] = signal.signal(signum, self._receive)

  def _receive(self, signum, frame) -> None:
    del frame
    if self._received is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # A second Ctrl-C does not wait for the save.
    self._received = signal.Signals(signum).name
    print(f'{self._received}: stopping after this step, with a checkpoint '
          '(Ctrl-C again to stop at once).', flush=True)

  def due(self, step: int) -> bool:
    """Whether to save and stop after `step` (call it after every step)."""
    if (self._multihost and self._received is None
        and ocp.multihost.reached_preemption(step)):
      self._received = 'a preemption notice'
    return self._received is not None

  @property
  def reason(self) -> str | None:
    """What asked to stop: SIGTERM, SIGINT or a preemption notice."""
    return self._received

  def close(self) -> None:
    """Puts back the signal handlers there were before."""
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}
