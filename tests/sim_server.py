"""Test equipment: the simulated runtime (the package images/local-sim/sim) run as a process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

IMAGE_DIR = Path(__file__).resolve().parent.parent / "images" / "local-sim"
PACKAGE = IMAGE_DIR / "sim"
# Run from the image folder, as the image runs it from /opt/sparkforge; -B because bytecode left
# in the image folder would enter local-sim's build context, and so its key.
COMMAND = [sys.executable, "-B", "-m", "sim"]


def make_model(folder: Path) -> Path:
    """A small complete model folder: config, index and the two shards it names."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = {f"layers.{n}.weight": f"model-{n:05d}-of-00002.safetensors" for n in (1, 2)}
    (folder / "config.json").write_text('{"model_type": "deepseek_v41"}')
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    for name in shards.values():
        (folder / name).write_bytes(b"\0" * 64)
    return folder


class Sim:
    """A running simulator process on a free loopback port."""

    def __init__(self, model: Path, env: dict[str, str]):
        full = {"SIM_MODEL_DIR": str(model), "SIM_PORT": "0", "SIM_SERVED_MODEL_NAME": "sim"}
        self.proc = subprocess.Popen(
            COMMAND,
            cwd=IMAGE_DIR,
            env={**full, **env},
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stderr.readline()
        if "serving" not in line:
            self.proc.kill()
            raise RuntimeError(f"simulator did not start: {line}")
        self.url = "http://" + line.rsplit(" on ", 1)[1].strip()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=5)
