"""torchrun, with an interrupt said in one line: `python -m pipelab.runtime.launcher.torchrun ARGS` is `torchrun ARGS`.

torchrun's agent (`torch.distributed.run`, torch's code, not pipelab's) turns Ctrl-C (SIGINT) or SIGTERM into a
`SignalException` once it has stopped the ranks, and lets it end the process: a traceback, exit code 1.  The
ranks (`python -m pipelab.launch`) cannot change that: they run in processes of their own.  `run` is the
agent's own main, the exception caught: "torchrun: interrupted: the ranks were stopped" and 128 + the signal's
number (130 for Ctrl-C, 143 for SIGTERM), as `pipelab run --backend distributed` (`processes.py`) says it.
A failed run keeps torchrun's own summary and exit code.
"""

from __future__ import annotations

import signal
import sys


def run(argv: list[str] | None = None) -> int:
    """torchrun's main on `argv` (default: this command line); 0, or 128 + the signal that interrupted it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        main(argv)
    except (SignalException, KeyboardInterrupt) as signalled:
        number = int(getattr(signalled, "sigval", signal.SIGINT))
        what = "interrupted" if number == signal.SIGINT else f"ended by {signal.Signals(number).name}"
        print(f"torchrun: {what}: the ranks were stopped", file=sys.stderr)
        return 128 + number
    return 0


if __name__ == "__main__":
    sys.exit(run())
