"""The `vramplan` command (its console script) and `python -m vramplan`: `cli.main`, started and ended for speed.

`vramplan plan` is a short process, most of whose time is Python's own work around the command
(bench/startup.py measures it):
- importing the CLI, the planner and their libraries builds about 100,000 objects, and the cyclic collector ran 32
  times over them (6 ms). It is off while they load; `cli.main` keeps it off for short commands and turns it back on
  for the long ones (run, calibrate, probe).
- at exit the interpreter collects once more, over everything still alive (24 ms). `gc.freeze()` moves those objects
  to the permanent generation, which that last pass skips. Modules are still torn down, each object is still freed
  when its last reference goes, atexit handlers still run, and the standard streams are still flushed: only cycles
  left over at exit stay unvisited, as they would after os._exit, and the OS takes their memory back with the rest.

Tests call `cli.main` in-process and so never freeze their interpreter.

SIGTERM and Ctrl-C end a command with exit 130 and "interrupted" from the first instant, during the imports too.
"""

import gc
import signal
import sys

# cli.py's code for a command ended by Ctrl-C or SIGTERM.
EXIT_INTERRUPTED = 130


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def console() -> None:
    # SIGTERM ends a command like Ctrl-C from the first instant, not only once cli.main runs (importing the CLI takes
    # a few hundred milliseconds, and SIGTERM's default would end the process with 143 and no word).
    signal.signal(signal.SIGTERM, _interrupt)
    gc.disable()
    try:
        from vramplan.cli import main

        main()
    except KeyboardInterrupt:  # before cli.main could take it: while the CLI was still being imported
        sys.stderr.write("interrupted\n")
        sys.exit(EXIT_INTERRUPTED)
    finally:
        gc.freeze()


if __name__ == "__main__":
    console()
