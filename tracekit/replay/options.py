"""How to replay a bundle: one typed object from the command line (or a caller) down to the replay.

Kept apart from the replay itself, which needs torch: `tracekit replay` builds it in a process
that never imports torch, and the work it forks takes it from there.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracekit.format.schema import KernelChoice
    from tracekit.integrations.vllm.replay_engine import EngineNeeds


@dataclass
class ReplayOptions:
    """How to replay a bundle. `modes`: None (check only), "reference" (also time the forward
    as the engine ran it), a mode, or "all". `layers_out`: also run the step eagerly capturing
    every layer's output, into a bundle there (a bundle recorded with `--layers` is always
    checked layer by layer against such an eager forward). `strict`: the exit code is 0 for a
    bit-exact replay only. `profile_prefix`: each timed mode's forwards are also traced with the
    torch profiler into `{profile_prefix}.{mode}.trace.json`. `full_engine`: build the engine as vLLM
    builds it (every graph and compile size) instead of a lean one with what the step needs;
    `engine_needs`: what the lean engine must hold (a suite passes its group's; default: this
    step's, and what `modes` asks). `from_step`: in a window, rebuild the runner's state at that
    step as a single-step replay builds it, instead of letting it carry its state into it.
    `repeats`: how many more times a single step that does not reproduce is replayed from the
    same restored state, here and (where those agree and it diverged) in a fresh process, to tell
    an engine that does not repeat itself (`nondeterministic`) from a divergence; 0: not at all
    (`tracekit.replay.repeats`). `repeat_fresh`: False in that fresh process itself."""

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
    kernel_choices: "list[KernelChoice] | None" = None  # a suite's engine's, for all its bundles
    # LoRA adapter name -> its folder here, where the bundle does not keep its files and it is
    # not at the recorded path (`--lora NAME=PATH`)
    lora_paths: dict[str, str] = field(default_factory=dict)
    repeats: int = 2
    repeat_fresh: bool = True
