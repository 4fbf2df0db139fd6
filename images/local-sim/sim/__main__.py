"""`python3 -m sim`: check the model folder, then serve (or write the tokenizer files)."""

from __future__ import annotations

import os
import signal
import sys
from http.server import ThreadingHTTPServer
from pathlib import Path

from .engine import Engine
from .handler import Handler
from .model_folder import missing_model_files
from .settings import Settings
from .tokenizer import write_tokenizer


class Server(ThreadingHTTPServer):
    """Threads per connection, a deep accept backlog (eight streams connect at once)."""

    daemon_threads = True
    request_queue_size = 256


def stop(signum: int, frame: object) -> None:
    """Leave serve_forever: a stop signal ends the server (its streams with it), exit 0."""
    sys.exit(0)


def main(argv: list[str]) -> None:
    """Serve SIM_MODEL_DIR, or with `--write-tokenizer DIR` write the tokenizer files there."""
    settings = Settings.from_env(dict(os.environ))
    if len(argv) == 2 and argv[0] == "--write-tokenizer":
        write_tokenizer(Path(argv[1]), settings.max_model_len)
        return
    missing = missing_model_files(settings.model_dir)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        sys.exit(f"simulator: model folder {settings.model_dir} incomplete: {missing[0]}{more}")
    Handler.engine = Engine(settings)
    # A thread whose token is due must not wait 5 ms (the default) for another's GIL slice.
    sys.setswitchinterval(0.0005)
    server = Server((settings.host, settings.port), Handler)
    # In its container the simulator is the first process (PID 1), to which the kernel delivers
    # no signal it has no handler for: `docker stop`'s SIGTERM would be ignored, and every
    # redeploy and rollback would wait the whole grace period (10 s) for the engine's SIGKILL.
    signal.signal(signal.SIGTERM, stop)
    print(
        f"simulator: serving {settings.served_name} from {settings.model_dir} on"
        f" {settings.host}:{server.server_address[1]}",
        file=sys.stderr,
        flush=True,
    )
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
