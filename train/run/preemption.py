"""Stop requests: a signal or a preemption notice, acted on between calls.

A scheduler that preempts a job sends SIGTERM and waits a grace period; a
person at the terminal presses Ctrl-C (SIGINT). Either sets a flag, and the
training loop, at the end of a call (config.steps_per_call steps; the
host is one call ahead of the device, so up to 2K - 1 steps may run after
the signal), saves a checkpoint, waits for it to be written and exits
with status 0; running the same command resumes.

With several processes, every host must save the same step. There JAX's
preemption service (started by `jax.distributed.initialize`) owns SIGTERM:
when any host receives it, the hosts agree on a sync point one past the
furthest count any of them reported, and orbax's `reached_preemption(n)`
turns True on all of them at that count. The count is of calls, not steps:
with several steps a call the steps rise by more than one, and would pass
the sync point by. SIGINT is then left alone (Ctrl-C stops one host
without a save).
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
    self._calls = 0
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
    """Whether to save and stop after `step`, the last of a call (call it
    after every call, on every host). The answer does not depend on
    `step`: the hosts agree by a count of calls (see above); it names
    where the loop is, for a caller's logs and the tests' cues."""
    self._calls += 1
    if (self._multihost and self._received is None
        and ocp.multihost.reached_preemption(self._calls)):
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
