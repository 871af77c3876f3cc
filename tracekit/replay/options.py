"""How to replay a bundle: one typed object from the command line (or a caller) down to the replay.

Kept apart from the replay itself, which needs torch: `tracekit replay` builds it in a process
that never imports torch, and the work it forks takes it from there.
"""

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracekit.format.schema import KernelChoice
    from tracekit.integrations.vllm.replay_engine import EngineNeeds


@dataclass
class ReplayOptions:
    """How to replay a bundle. Each field the command line sets is one of `tracekit replay`'s
    options (`--help`; docs/GUIDE.md, "Replaying"), named alike but `step` (`--steps`),
    `from_step` (`--from`), `layers_out` (`--save-layers`), `lora_paths` (`--lora`),
    `engine_overrides` (the engine arguments) and `modes` (None: `--no-timing`; "reference"
    times the forward as the engine ran it). Set by callers:
    `profile_prefix` (each timed mode's trace is `{profile_prefix}.{mode}.trace.json`),
    `engine_needs` (what a lean engine must hold: a suite passes its group's; default: this
    step's and what `modes` asks), `kernel_choices` (a suite's engine's, for all its bundles) and
    `repeat_fresh` (False in the fresh process that repeats a step, `tracekit.replay.repeats`)."""

    step: int | None = None
    from_step: int | None = None
    model: str | None = None
    allow_weights_mismatch: bool = False
    engine_overrides: dict[str, Any] = field(default_factory=dict)
    modes: str | None = None
    iters: int = 10
    samples: int = 3
    warmup_s: float = 0.5
    tolerance: float = 0.0
    strict: bool = False
    layers_out: str | Path | None = None
    profile_prefix: str | Path | None = None
    full_engine: bool = False
    engine_needs: "EngineNeeds | None" = None
    kernel_choices: "list[KernelChoice] | None" = None
    lora_paths: dict[str, str] = field(default_factory=dict)
    repeats: int = 2
    repeat_fresh: bool = True


def options_from(options: ReplayOptions | None, fields: dict[str, Any]) -> ReplayOptions:
    """The options a Python caller gave: a `ReplayOptions`, its fields as keywords, or both (the
    keywords then change those fields of it: neither is ignored)."""
    return replace(options, **fields) if options is not None else ReplayOptions(**fields)
