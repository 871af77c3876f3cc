"""Naming a model's weights by their bytes, so that a replay can tell it found the recorded ones.

A bundle stores the fingerprint of the weights its engine loaded; a replay on another machine
finds them at another path (or under `--model`) and compares. Kept apart from the modules that
build engines because the release support (`release.Release.engine_config`) needs it too, and
importing those from there would close an import loop.
"""

import hashlib
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weights_fingerprint(model_path: str, load_format: str | None) -> str | None:
    """A hash over the weight files' names and bytes, plus config.json; None where the weights
    are not a local folder (a hub id resolved elsewhere)."""
    if load_format == "dummy":
        return "dummy"
    root = Path(model_path)
    if not root.is_dir():
        return None
    digest = hashlib.blake2b(digest_size=16)
    files = sorted(p for p in root.rglob("*") if p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                digest.update(chunk)
    return "blake2b-128:" + digest.hexdigest()
