"""Children with the signal dispositions a terminal gives them.

A suite started in the background (`cmd &`, nohup) has SIGINT (and SIGHUP) ignored, and every
child inherits that: a test that stops its child with a signal would then see it go on. Each
such child is started with these dispositions back to their defaults.
"""

from __future__ import annotations

import signal

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def default_signals() -> None:
    """A Popen preexec_fn: every stopping signal's default disposition in the child."""
    for stop in STOPPING:
        signal.signal(stop, signal.SIG_DFL)
