"""The server's settings: identity, address and timing model, from SIM_* env."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    """The timing model and identity, from SIM_* env."""

    model_dir: Path
    served_name: str
    max_model_len: int
    max_running: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    decode_falloff: float
    decode_jitter: float
    tokens_per_chunk: int
    empty_chunks: bool
    host: str
    port: int
    missing_routes: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Settings:
        """Settings from the environment, with the profile's defaults."""
        return cls(
            model_dir=Path(env.get("SIM_MODEL_DIR", "/models")),
            served_name=env.get("SIM_SERVED_MODEL_NAME", "simulated"),
            max_model_len=int(env.get("SIM_MAX_MODEL_LEN", "131072")),
            max_running=max(1, int(env.get("SIM_MAX_RUNNING", "8"))),
            ttft_s=float(env.get("SIM_TTFT_S", "0.05")),
            prefill_tok_s=float(env.get("SIM_PREFILL_TOK_S", "20000")),
            decode_tok_s=float(env.get("SIM_DECODE_TOK_S", "200")),
            decode_falloff=float(env.get("SIM_DECODE_FALLOFF", "0")),
            decode_jitter=min(0.9, max(0.0, float(env.get("SIM_DECODE_JITTER", "0")))),
            tokens_per_chunk=max(1, int(env.get("SIM_TOKENS_PER_CHUNK", "1"))),
            empty_chunks=env.get("SIM_EMPTY_CHUNKS", "0").lower() in ("1", "true", "yes"),
            host=env.get("SIM_HOST", "127.0.0.1"),
            port=int(env.get("SIM_PORT", "8000")),
            missing_routes=frozenset(
                r.strip() for r in env.get("SIM_MISSING_ROUTES", "").split(",") if r.strip()
            ),
        )
