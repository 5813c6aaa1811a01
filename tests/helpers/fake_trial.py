"""A stand-in for a trial's `python -m train.train`, for the tests of what
runs it (experiments/trials.py), started as it would be:

  python -m tests.helpers.fake_trial --config=FILE --workdir=DIR \
      --config.seconds=S

It "trains" for S seconds in all, however many runs (attempts) that takes:
SIGTERM makes it save the seconds it has done (as a checkpoint would) and
stop with status 0, and a run after that does the rest, then leaves the
final evaluation of a finished run (config.json and metrics.jsonl, at
step 1 of 1). Each attempt appends its start, its end and how it ended to
DIR/attempts.jsonl, by its own clock: the test's reference.

In-process, `exiting` stands in for subprocess.Popen where a test needs
no process of its own: a trial that ends at once.
"""

from collections.abc import Callable
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

# Seconds a save takes after a SIGTERM.
SAVE_S = 0.3
_POPEN = subprocess.Popen


def exiting(status: int, leaves: Callable[[list[str], dict], None] =
            lambda command, options: None) -> Callable[..., subprocess.Popen]:
  """A stand-in for subprocess.Popen, for experiments/trials.py to run a
  trial with: the trial's process ends at once with `status`, having left
  what `leaves(command, options)` writes (`options`: Popen's keyword
  arguments; `stdout`, the trial's log)."""
  def popen(command: list[str], **options) -> subprocess.Popen:
    leaves(command, options)
    return _POPEN(['sh', '-c', f'exit {status}'])
  return popen


def main(argv: list[str]) -> None:
  flags = dict(arg.removeprefix('--').split('=', 1) for arg in argv)
  workdir, seconds = flags['workdir'], float(flags['config.seconds'])
  start = time.time()
  progress = pathlib.Path(workdir, 'progress')
  done = float(progress.read_text()) if progress.exists() else 0.0

  def attempt(ended: str) -> None:
    with open(os.path.join(workdir, 'attempts.jsonl'), 'a') as f:
      f.write(json.dumps({'pid': os.getpid(), 'start': start,
                          'end': time.time(), 'ended': ended}) + '\n')

  def stop(signum, frame):
    del signum, frame
    progress.write_text(str(done + time.time() - start))
    time.sleep(SAVE_S)
    attempt('SIGTERM')
    print('Stopped after saving.', flush=True)  # Its log's last write.
    sys.exit(0)

  signal.signal(signal.SIGTERM, stop)
  with open(os.path.join(workdir, 'started'), 'w') as f:
    f.write(str(os.getpid()))
  time.sleep(max(seconds - done, 0.0))
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump({'num_train_steps': 1}, f)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    f.write(json.dumps({'step': 1, 'eval_loss': 1.0}) + '\n')
  attempt('finished')
  print('Trained to the last step.', flush=True)


if __name__ == '__main__':
  main(sys.argv[1:])
