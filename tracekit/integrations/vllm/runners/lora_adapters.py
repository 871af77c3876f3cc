"""The LoRA adapters of a recorded step: which sat in which slot, their files, and putting them back.

What a step computes depends on the adapters in the engine's LoRA slots (`runner.lora_manager`),
not only on its requests' own: docs/GUIDE.md ("LoRA") says why, and which files are kept (never a
pickle, which loading would execute).
"""

import json
import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tracekit.errors import BundleError, CannotRunHere
from tracekit.format.schema import ADAPTER_CONFIG, KEPT_WEIGHTS_SUFFIX, LoRAAdapter, Step
from tracekit.integrations.vllm.records.weights import adapter_fingerprint, weight_files

logger = logging.getLogger("tracekit.record")

# Adapters whose files add up to at most this are kept in the bundle (`--keep-lora-weights`: any size).
KEEP_LIMIT = 64 << 20
# Slot ids of the zero adapters a replay puts into slots the recording had empty (above any real id).
GAP_FILLER_IDS = 1 << 30


# -- recording ---------------------------------------------------------------------------------


def slot_table(runner: Any) -> list[int | None]:
    """The int id of the adapter in each LoRA slot (None: empty); [] for an engine without LoRA."""
    manager = getattr(runner, "lora_manager", None)
    if manager is None:
        return []
    return list(manager._adapter_manager.lora_index_to_id)


def request_adapter_name(request: Any) -> str | None:
    """The adapter a request object (V1's CachedRequestState, a NewRequestData) runs with."""
    lora_request = getattr(request, "lora_request", None)
    return lora_request.lora_name if lora_request is not None else None


def resident_adapters(slots: list[int | None], known: dict[int, Any]) -> list[LoRAAdapter]:
    """The adapters of a slot table, by the LoRA requests seen (int id -> LoRARequest); one loaded
    before the recorder saw its request keeps only its id and slot."""
    adapters = []
    for slot, int_id in enumerate(slots):
        if int_id is None:
            continue
        lora_request = known.get(int_id)
        adapters.append(LoRAAdapter(
            name=lora_request.lora_name if lora_request is not None else None,
            int_id=int(int_id),
            slot=slot,
            path=str(lora_request.lora_path) if lora_request is not None else None,
        ))
    return adapters


class AdapterFiles:
    """Reads recorded adapters' files on the writer thread; what every bundle of a session needs
    of one adapter (fingerprint, config, sizes) is read once."""

    def __init__(self, keep_always: bool = False):
        self.keep_always = keep_always
        self._known: dict[tuple[int, str], dict[str, Any]] = {}
        self._unreadable: set[tuple[int, str]] = set()  # said once each

    def complete(self, step: Step) -> None:
        """Fill in each resident adapter's identity from its files, and the files when kept. An
        adapter whose files cannot be read (gone, unreadable, a broken config) keeps only its name,
        id, slot and path, said once: the bundle is written all the same."""
        for adapter in step.lora_adapters:
            folder = _local_folder(adapter.path)
            if folder is None:
                continue
            try:
                facts = self._facts(adapter.int_id, folder)
                files = ({path.name: _bytes_tensor(path.read_bytes()) for path in facts["files"]}
                         if facts["keepable"] and (self.keep_always or facts["size_bytes"] <= KEEP_LIMIT) else {})
            except (OSError, ValueError) as error:  # (json's errors are ValueErrors)
                if (adapter.int_id, str(folder)) not in self._unreadable:
                    self._unreadable.add((adapter.int_id, str(folder)))
                    logger.warning("tracekit: LoRA adapter %r at %s cannot be read (%s: %s): bundles name it "
                                   "without a fingerprint or its files", adapter.name, folder, type(error).__name__, error)
                continue
            adapter.fingerprint, adapter.size_bytes = facts["fingerprint"], facts["size_bytes"]
            adapter.rank, adapter.alpha, adapter.target_modules = facts["rank"], facts["alpha"], facts["target_modules"]
            adapter.files = files

    def _facts(self, int_id: int, folder: Path) -> dict[str, Any]:
        key = (int_id, str(folder))
        if key not in self._known:
            files = weight_files(folder, ADAPTER_CONFIG)
            config = json.loads((folder / ADAPTER_CONFIG).read_text()) if (folder / ADAPTER_CONFIG).is_file() else {}
            config = config if isinstance(config, dict) else {}
            targets = config.get("target_modules") or []
            self._known[key] = {
                "fingerprint": adapter_fingerprint(folder),
                "size_bytes": sum(path.stat().st_size for path in files),
                "rank": config.get("r") if isinstance(config.get("r"), int) else None,
                "alpha": float(config["lora_alpha"]) if isinstance(config.get("lora_alpha"), (int, float)) else None,
                "target_modules": [str(name) for name in targets] if isinstance(targets, list) else [str(targets)],
                "files": files,
                # every fingerprinted file can be written back as it was, and none is a pickle
                "keepable": all(path.parent == folder
                                and (path.name == ADAPTER_CONFIG or path.suffix == KEPT_WEIGHTS_SUFFIX)
                                for path in files),
            }
        return self._known[key]


def _local_folder(path: str | None) -> Path | None:
    if not path:
        return None
    folder = Path(path).expanduser()
    return folder.resolve() if folder.is_dir() else None


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


# -- replaying ---------------------------------------------------------------------------------


class LocatedAdapters:
    """Where each adapter of a step is on this machine (int id -> folder), checked against the
    recorded fingerprint; a folder written from kept files is removed on `close()`."""

    def __init__(self) -> None:
        self.paths: dict[int, str] = {}
        self._written: Path | None = None

    def __enter__(self) -> "LocatedAdapters":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        written, self._written = self._written, None
        if written is not None:
            shutil.rmtree(written, ignore_errors=True)

    def folder_for(self, adapter: LoRAAdapter) -> Path:
        """A fresh folder of this replay's for one adapter's kept files."""
        if self._written is None:
            self._written = Path(tempfile.mkdtemp(prefix="tracekit-lora-"))
        folder = self._written / str(adapter.int_id)
        folder.mkdir()
        return folder


def locate(step: Step, given: Mapping[str, str], allow_mismatch: bool) -> LocatedAdapters:
    """Find every adapter the step's slots held: its kept files (written to a folder of the
    replay's), else `given[name]`, else its recorded path; refused (exit 3) where it is not found
    or its fingerprint differs (unless `allow_mismatch`)."""
    located = LocatedAdapters()
    try:
        for adapter in step.lora_adapters:
            _check_record(adapter)
            folder = _write_kept(adapter, located) if adapter.files else _found(adapter, given)
            here = adapter_fingerprint(folder)
            if adapter.fingerprint is not None and here != adapter.fingerprint and not allow_mismatch:
                raise CannotRunHere(
                    f"LoRA adapter {adapter.name!r} at {folder} differs from the recorded one ({here} vs "
                    f"{adapter.fingerprint}): pass --lora {adapter.name}=PATH to the recorded adapter, or "
                    "--allow-weights-mismatch to replay anyway"
                )
            located.paths[adapter.int_id] = str(folder)
    except BaseException:
        located.close()
        raise
    return located


def _check_record(adapter: LoRAAdapter) -> None:
    """A stranger's bundle: each kept file is bytes (its name was checked when the bundle was read)."""
    for name, data in adapter.files.items():
        if not (isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == 1):
            raise BundleError(f"bundle content: LoRA adapter {adapter.name!r}'s file {name!r} should be uint8 bytes")


def _write_kept(adapter: LoRAAdapter, located: LocatedAdapters) -> Path:
    folder = located.folder_for(adapter)
    for name, data in adapter.files.items():
        (folder / name).write_bytes(data.numpy().tobytes())
    return folder


def _found(adapter: LoRAAdapter, given: Mapping[str, str]) -> Path:
    """An adapter the bundle does not keep: at the path given for its name, else its recorded one."""
    if adapter.name is None:
        raise CannotRunHere(
            f"LoRA slot {adapter.slot} held an adapter (id {adapter.int_id}) loaded before the recorder was "
            "armed, which the bundle cannot name: arm the recorder before the adapter's first request"
        )
    path = given.get(adapter.name) or adapter.path
    folder = Path(path).expanduser() if path else None
    if folder is None or not folder.is_dir():
        raise CannotRunHere(
            f"LoRA adapter {adapter.name!r} ({adapter.fingerprint or 'no fingerprint'}) is not in the bundle and not "
            f"at {path}: pass --lora {adapter.name}=PATH, or record with --keep-lora-weights"
        )
    return folder


def lora_request(adapter: LoRAAdapter, path: str) -> Any:
    """The `LoRARequest` a replayed request names its adapter with."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name or f"tracekit-lora-{adapter.int_id}", lora_int_id=adapter.int_id,
                       lora_path=path)


def lora_requests(adapters: list[LoRAAdapter], paths: dict[int, str]) -> dict[str, Any]:
    """The LoRARequest of each located adapter (`paths`: `locate`'s), by name, as the replayed
    requests name them."""
    return {adapter.name: lora_request(adapter, paths[adapter.int_id]) for adapter in adapters if adapter.int_id in paths}


def restore_slots(runner: Any, adapters: list[LoRAAdapter], paths: dict[int, str]) -> None:
    """Load the recorded adapters into the recorded slots (the step's own activation then finds
    each where it was). vLLM fills the first free slot: a slot the recording had empty before an
    occupied one gets one of vLLM's zero warm-up adapters while the next is placed, then is freed.
    Every slot the recording had empty is zeroed last, as an unused slot is (GUIDE's "LoRA" says
    why: vLLM frees a slot without clearing it)."""
    manager = getattr(runner, "lora_manager", None)
    if manager is None:
        if adapters:
            raise CannotRunHere("the step ran with LoRA adapters, and the replay engine has LoRA off")
        return
    slots = manager._adapter_manager
    manager.remove_all_adapters()
    by_slot = {adapter.slot: adapter for adapter in adapters}
    if by_slot and max(by_slot) >= len(slots.lora_index_to_id):
        raise CannotRunHere(f"the step's LoRA adapters sat in slot {max(by_slot)}; the replay engine has "
                            f"{len(slots.lora_index_to_id)} (max_loras)")
    fillers = []
    with manager.dummy_lora_cache():
        for slot in range(max(by_slot, default=-1) + 1):
            adapter = by_slot.get(slot)
            if adapter is not None:
                manager.add_adapter(lora_request(adapter, paths[adapter.int_id]))
                continue
            filler = GAP_FILLER_IDS + slot
            manager.add_dummy_lora(lora_request(LoRAAdapter(name=None, int_id=filler, slot=slot), "/"),
                                   rank=int(runner.lora_config.max_lora_rank))
            slots.activate_adapter(filler)
            fillers.append(filler)
    for filler in fillers:
        manager.remove_adapter(filler)
    for slot in range(len(slots.lora_index_to_id)):
        if slot not in by_slot:
            for module in slots.modules.values():
                module.reset_lora(slot)
