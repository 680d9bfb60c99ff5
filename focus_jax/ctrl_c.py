"""Ctrl-C for commands that spend long stretches inside one native call.

Python turns SIGINT into ``KeyboardInterrupt`` only when its main thread runs Python again: an
XLA compile does not return for seconds on a CPU, a minute for SDAR-8B on a GPU, so Ctrl-C
would wait for it. :func:`exit_promptly` has the signal itself wake a thread (Python's
``signal.set_wakeup_fd``, written from the C handler at once); if the main thread has not ended
the process within :data:`GRACE_SECONDS`, that thread does: one line, status 130. Only for
commands that leave nothing half-written (a compile interrupted this way writes no cache entry,
or a truncated one that JAX reports and compiles again).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

GRACE_SECONDS = 1.0
"""How long the main thread has to end the process itself (``KeyboardInterrupt``)."""
MESSAGE = "focus-jax: interrupted"
_STOP = b"\0"  # not a signal number: wakes the watcher to end it


def exit_now(status: int = 130) -> None:
    """End the process with ``status`` (130: as a shell reports SIGINT) at once, its output
    flushed. Not through the interpreter's shutdown: a device program still running then has
    XLA's runtime abort the process ("terminate called without an active exception", status
    -6), and a compile still running is waited for."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


@contextlib.contextmanager
def exit_promptly() -> Iterator[None]:
    """While the block runs, Ctrl-C ends the process within :data:`GRACE_SECONDS` whatever the
    main thread is doing (unless the main thread has left the block by then). Main thread only;
    outside it (an embedding thread) nothing changes."""
    left = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write)

    def watch() -> None:
        while (data := os.read(read, 64)) and _STOP not in data:
            if bytes([signal.SIGINT]) in data:
                if left.wait(GRACE_SECONDS):
                    return  # the main thread handled it and left the block
                print(MESSAGE, file=sys.stderr, flush=True)
                exit_now()

    # A KeyboardInterrupt raised where Python cannot propagate it (a garbage-collector callback,
    # such as the one JAX registers, or a __del__) would print "Exception ignored in ..." and a
    # traceback, and the main thread would go on: the watcher ends the process within the grace
    # time with the one line, so those are not printed.
    unraisable_hook = sys.unraisablehook

    def quiet_interrupts(unraisable) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            unraisable_hook(unraisable)

    sys.unraisablehook = quiet_interrupts
    watcher = threading.Thread(target=watch, name="focus-jax-ctrl-c", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        left.set()
        sys.unraisablehook = unraisable_hook
        signal.set_wakeup_fd(previous)
        os.write(write, _STOP)
        watcher.join()
        os.close(read)
        os.close(write)
