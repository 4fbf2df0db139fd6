"""How Python's cyclic garbage collector runs in a doit process.

A doit run imports large libraries (botocore's service models, protobuf descriptors, the
signing stack) and then keeps most of what they made until it exits. Two of the collector's
defaults cost a short run much of its time (tests/perf/remote_cache.py, a build restored from the
remote cache in about a second): collecting the youngest generation every 700 allocations, 300
collections and 0.1 s of it, almost all of them walking import-time objects that stay; and the
full collection at interpreter exit, 0.2 s walking everything once more to free memory the exit
frees anyway.
"""

from __future__ import annotations

import atexit
import gc

# Ten times the default: a collection per 7,000 net allocations of tracked objects. A long
# deploy still collects, each time freeing what cycles were left since the one before.
YOUNG_THRESHOLD = 7000


def tune_collector() -> None:
    """Collect the youngest generation less often, and skip the collection at exit.

    At exit, after atexit's other handlers (temporary folders are removed by their finalizers'
    own handler, files closed by their with-blocks), a last collection would find only memory
    to free, which the exit frees anyway; Python does not promise `__del__` of what is left at
    exit in any case. gc.freeze moves every object out of the collector's sight, so the
    interpreter's last collection walks nothing.
    """
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    atexit.register(gc.freeze)
