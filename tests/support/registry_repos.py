"""Registry repositories a test or a benchmark made, removed again: importing this changes
nothing (support.stack points the stack's variables at the tests' own stack when imported)."""

from __future__ import annotations


def delete_repository(registry: str, repository: str) -> None:
    """Delete every manifest a repository's tags point to (the stack's registry allows it)."""
    import requests

    from pipelines.stages.images.registry import ACCEPT

    base = f"http://{registry}/v2/{repository}"
    tags = requests.get(f"{base}/tags/list", timeout=10).json().get("tags") or []
    digests = {
        requests.head(f"{base}/manifests/{tag}", headers={"Accept": ACCEPT}, timeout=10).headers[
            "Docker-Content-Digest"
        ]
        for tag in tags
    }
    for digest in digests:
        requests.delete(f"{base}/manifests/{digest}", timeout=10).raise_for_status()
