"""Recording settings as users give them, checked once before anything is armed, however they
came (`tracekit record`, `recording(llm)`, the plugin's variables, a request to arm a running
server: `tracekit.record.live`), each refusal one line naming the setting as the user spelled it;
the folder a request to arm may name: `bundle_folder`. Needs neither torch nor vLLM: the
`tracekit arm` client checks a request here before sending it.
"""

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracekit.errors import UsageError
from tracekit.format.schema import KV_MODES
from tracekit.record.triggers import CLI_NAMES, DEFAULT_MAX_BUNDLES, SettingNames, TriggerSet


def bundles(count: int) -> str:
    """`1 bundle`, `3 bundles`: how the messages count them."""
    return f"{count} bundle{'' if count == 1 else 's'}"


@dataclass(frozen=True)
class RecordSettings:
    """What a recording takes; `check` refuses a bad setting in one line naming it as the user
    spelled it (`names`)."""

    steps: str | None = None
    when: str | None = None
    on: tuple[str, ...] = ()
    kv: str = "read"
    max_bundles: int = DEFAULT_MAX_BUNDLES
    window: int = 1  # consecutive steps per bundle from a firing step on (`record --window N`)
    layers: bool = False  # also store every decoder layer's output of a recorded step (eager engines)
    keep_lora_weights: bool = False  # keep every LoRA adapter's files, whatever their size

    def check(self, names: SettingNames = CLI_NAMES) -> TriggerSet:
        """The triggers, every setting checked. A window is refused where the recorder cannot
        take it: fewer than one step, or opened by an event trigger (it decides after its step,
        when the next one may already have been sent)."""
        if self.kv not in KV_MODES:
            raise UsageError(f"bad {names.kv} {self.kv!r}: choose one of {', '.join(KV_MODES)}")
        if self.max_bundles < 1:
            raise UsageError(f"bad {names.max_bundles} {self.max_bundles}: must be at least 1")
        triggers = TriggerSet(steps=self.steps, when=self.when, events=tuple(self.on), names=names)
        if self.window < 1:
            raise UsageError(f"bad {names.window} {self.window}: a window holds at least one step")
        if self.window > 1 and triggers.events:
            raise UsageError(f"{names.window} starts at a step trigger ({names.steps} or {names.when}); {names.on} "
                             "exception/nonfinite decides only after its step, when the next may already run: record "
                             f"the window with {names.steps}/{names.when}")
        return triggers


SERVE_DIR_VARIABLE = "TRACEKIT_SERVE_DIR"
# The settings as a request to arm names them (its JSON fields).
ROUTE_NAMES = SettingNames(steps="steps", when="when", on="on", kv="kv", max_bundles="max_bundles",
                           window="window", output="output")
_ROUTE_FIELDS = tuple(ROUTE_NAMES.__dataclass_fields__)
_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
_MOST_FOLDER_CHARS = 200


@dataclass(frozen=True)
class LiveSettings(RecordSettings):
    """A request to arm, checked: the folder under the served one, and what it records."""

    output: str = ""

    def plain(self) -> dict[str, Any]:
        """The request's own fields, as sent to every worker."""
        return {name: list(self.on) if name == "on" else getattr(self, name) for name in _ROUTE_FIELDS}


def check_settings(body: Any, names: SettingNames = ROUTE_NAMES) -> LiveSettings:
    """A request's settings, every one checked without touching the disk; a bad one is refused
    in one line naming it as `names` spells it. `output` defaults to a fresh timestamped name."""
    if not isinstance(body, dict):
        raise UsageError("the request to arm must be a JSON object of settings")
    unknown = sorted(set(body) - set(_ROUTE_FIELDS))
    if unknown:
        raise UsageError(f"unknown setting {unknown[0]!r} (known: {', '.join(_ROUTE_FIELDS)})")
    on = body.get("on") or ()
    if isinstance(on, str):
        on = tuple(event.strip() for event in on.split(",") if event.strip())
    if not (isinstance(on, (list, tuple)) and all(isinstance(event, str) for event in on)):
        raise UsageError(f"bad {names.on}: give events as text, e.g. exception,nonfinite")
    settings = LiveSettings(
        output=_text(body, "output", names.output) or time.strftime("live-%Y%m%d-%H%M%S"),
        steps=_text(body, "steps", names.steps),
        when=_text(body, "when", names.when),
        on=tuple(on),
        kv=_text(body, "kv", names.kv) or "read",
        max_bundles=_whole(body, "max_bundles", names.max_bundles, DEFAULT_MAX_BUNDLES),
        window=_whole(body, "window", names.window, 1),
    )
    settings.check(names)
    require_folder_name(settings.output, names.output)
    return settings


def require_folder_name(name: str, setting: str = ROUTE_NAMES.output) -> None:
    """A folder name relative to the served folder, plainly spelled: no absolute path, no `..`,
    no `{step}`-style placeholders or other characters a path could hide behind."""
    if len(name) > _MOST_FOLDER_CHARS or not _FOLDER_NAME.fullmatch(name):
        raise UsageError(f"bad {setting} {name!r}: name a folder under the server's bundle folder "
                         "(letters, digits, '.', '_', '-', sub-folders with '/'; no absolute path, no '..')")


def bundle_folder(served: str | Path, name: str, setting: str = ROUTE_NAMES.output) -> Path:
    """The empty folder `name` under the served folder, made if absent: refused if it would
    resolve outside it (a symlink on the way), or already holds anything (nothing is overwritten)."""
    require_folder_name(name, setting)
    root = Path(os.path.realpath(served))
    target = Path(os.path.realpath(root / name))
    if not target.is_relative_to(root) or target == root:
        raise UsageError(f"bad {setting} {name!r}: it resolves to {target}, outside the server's bundle folder "
                         f"{root} (a symlink on the way?)")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"bad {setting} {name!r}: {target} already exists and is not an empty folder "
                         "(name a new one: nothing is overwritten)")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"cannot make {target}: {error.strerror or error}") from None
    if Path(os.path.realpath(target)) != target:  # swapped for a link while it was made
        raise UsageError(f"bad {setting} {name!r}: {target} changed while it was made")
    return target


def served_folder() -> Path | None:
    """The folder the operator named at start (None: live control is off)."""
    folder = os.environ.get(SERVE_DIR_VARIABLE)
    return Path(folder) if folder else None


def _text(body: dict, key: str, setting: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise UsageError(f"bad {setting} {value!r}: give it as text")
    return value or None


def _whole(body: dict, key: str, setting: str, default: int) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"bad {setting} {value!r}: give a whole number")
    return value
