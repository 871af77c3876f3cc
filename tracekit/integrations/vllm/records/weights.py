"""Naming weights by their bytes, so that a replay can tell it found the recorded ones: a bundle
stores the fingerprint of the weights its engine loaded — the model's and each LoRA adapter's, one
definition for both — and a replay on another machine finds them at another path (or under
`--model`, `--lora`) and compares.
"""

import hashlib
import threading
from pathlib import Path

from tracekit.format.schema import ADAPTER_CONFIG

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
MODEL_CONFIG = "config.json"


def weight_files(root: Path, config_name: str) -> list[Path]:
    """The files a fingerprint covers: every weight file under `root`, and its config file."""
    return sorted(path for path in root.rglob("*")
                  if path.is_file() and (path.suffix in WEIGHT_SUFFIXES or path.name == config_name))


def files_fingerprint(root: Path, config_name: str) -> str | None:
    """`blake2b-128:HEX` over the relative names and bytes of `weight_files`; None where `root` is
    not a local folder (a hub id resolved elsewhere). Hashing a large model takes seconds to
    minutes, so each result is kept for this process while the files' sizes and times stand (a
    live server arms again and again; the first is hashed off the engine's thread)."""
    if not root.is_dir():
        return None
    files = weight_files(root, config_name)
    stamp = (str(root.resolve()), tuple((str(path), path.stat().st_size, path.stat().st_mtime_ns) for path in files))
    with _hashing:
        if stamp not in _fingerprints:
            digest = hashlib.blake2b(digest_size=16)
            for path in files:
                digest.update(str(path.relative_to(root)).encode() + b"\0")
                with path.open("rb") as stream:
                    for chunk in iter(lambda: stream.read(1 << 20), b""):
                        digest.update(chunk)
            _fingerprints[stamp] = "blake2b-128:" + digest.hexdigest()
        return _fingerprints[stamp]


_fingerprints: dict[tuple, str] = {}
_hashing = threading.Lock()  # one hash at a time: a second caller of the same files waits for the first


def weights_fingerprint(model_path: str, load_format: str | None) -> str | None:
    """The model's: its weight files and config.json ("dummy" for vLLM's dummy weights). A model
    named by hub id is fingerprinted in the folder it resolves to here (`local_model_folder`);
    None where it resolves to none."""
    if load_format == "dummy":
        return "dummy"
    folder = local_model_folder(model_path)
    return files_fingerprint(folder, MODEL_CONFIG) if folder is not None else None


def local_model_folder(model: str) -> Path | None:
    """The folder a model lies in on this machine: `model` itself, or for a hub id
    (`org/name`), its snapshot in the Hugging Face cache, where vLLM loaded it from (None where
    it is not there: nothing is downloaded)."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # not a hub id, not cached here, or no huggingface_hub: no folder
        return None


def adapter_fingerprint(adapter_path: str | Path) -> str | None:
    """A LoRA adapter's: its weight files and adapter_config.json."""
    return files_fingerprint(Path(adapter_path), ADAPTER_CONFIG)
