"""Debian's docker-registry started by a test on its own, with the configuration it needs."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import requests
from support.ports import spare_ports


def start_registry(folder: Path, config: dict) -> tuple[subprocess.Popen, str]:
    """docker-registry with config (auth, http extras) on a free loopback port, once it answers
    401; else another port: it cannot bind port 0, so a port taken meanwhile shows as the
    process exiting."""
    for attempt in range(5):
        host = f"127.0.0.1:{spare_ports()}"
        path = folder / f"registry-{attempt}.yml"
        storage = {"filesystem": {"rootdirectory": str(folder / "data")}}
        full = {"version": 0.1, "storage": storage, **config}
        full["http"] = {**config.get("http", {}), "addr": host}
        path.write_text(json.dumps(full))
        proc = subprocess.Popen(
            ["docker-registry", "serve", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if requests.get(f"http://{host}/v2/", timeout=1).status_code == 401:
                    return proc, host
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        proc.kill()
        proc.wait()
    raise AssertionError("the test registry did not start on any of 5 ports")
