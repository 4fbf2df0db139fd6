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


def key_tags(registry: str, repository: str) -> list[str]:
    """The key tags of a repository (none where it does not exist)."""
    import requests

    answer = requests.get(f"http://{registry}/v2/{repository}/tags/list", timeout=10)
    tags = (answer.json().get("tags") or []) if answer.status_code == 200 else []
    return [tag for tag in tags if tag.startswith("key-")]


def copy_image(registry: str, source: str, target: str, tag: str) -> None:
    """The image source:tag, and its attestation when it has one, in target under the same
    tags: every blob mounted from source (no byte uploaded), each manifest put as it is, the
    tag last (the image step's cache takes a key tag for a complete image)."""
    import requests

    from pipelines.stages.images.attestations import attestation_tag
    from pipelines.stages.images.registry import ACCEPT

    def manifest(ref: str) -> requests.Response | None:
        got = requests.get(f"{base}/{source}/manifests/{ref}", headers=headers, timeout=10)
        return got if got.status_code == 200 else None

    def put(got: requests.Response, ref: str) -> None:
        document = got.json()
        for blob in [document["config"], *document.get("layers", [])]:
            mounted = requests.post(
                f"{base}/{target}/blobs/uploads/",
                params={"mount": blob["digest"], "from": source},
                timeout=10,
            )
            assert mounted.status_code == 201, f"{target}: {blob['digest']} not mounted"
        content = {"Content-Type": got.headers["Content-Type"]}
        sent = requests.put(f"{base}/{target}/manifests/{ref}", data=got.content,
                            headers=content, timeout=10)  # fmt: skip
        sent.raise_for_status()

    base, headers = f"http://{registry}/v2", {"Accept": ACCEPT}
    image = manifest(tag)
    assert image is not None, f"{source}:{tag}: no such image"
    digest = image.headers["Docker-Content-Digest"]
    put(image, digest)
    attestation = manifest(attestation_tag(digest))
    if attestation is not None:
        put(attestation, attestation_tag(digest))
    put(image, tag)
