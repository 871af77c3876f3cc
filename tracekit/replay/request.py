"""What `tracekit replay` was asked, and the one function that carries it out.

The command line builds a `ReplayRequest` (`plan`) in a process that never imports torch: the
bundles found, how to replay each (`ReplayOptions`), and what no replay of them could honour
refused up front. It then forks, and the work (`carry_out`) chooses in the child: every rank of a
multi-rank step, one bundle in detail, or many as a regression suite. Nothing here prints: the
caller hears of each bundle's start and record as they come (`Listener`) and reports the outcome.
"""

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tracekit.bundles import find_bundles, unique_names
from tracekit.errors import EXIT_REPLAY_FAILED, UsageError
from tracekit.replay.opened import OpenedBundle
from tracekit.replay.options import ReplayOptions


@dataclass
class ReplayRequest:
    """The bundles to replay (each once, named uniquely), how, and the engine arguments given
    (parsed by vLLM in the process that replays). A single bundle stays open (`opened`): read once
    here, its replay takes its step from the same file."""

    bundles: list[Path]
    options: ReplayOptions
    engine_argv: list[str] = field(default_factory=list)
    keep_going: bool = False
    profile_dir: Path | None = None
    multi_rank: bool = False
    opened: OpenedBundle | None = None
    names: dict[Path, str] = field(default_factory=dict)

    def __enter__(self) -> "ReplayRequest":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.opened is not None:
            self.opened.close()

    def without(self, done: set[Path]) -> "ReplayRequest":
        """The same request for the bundles not in `done` (a suite going on after a crash)."""
        return dataclasses.replace(self, bundles=[bundle for bundle in self.bundles if bundle not in done])


def plan(specs: list[str], options: ReplayOptions, engine_argv: list[str] = (), keep_going: bool = False,
         profile_dir: Path | None = None) -> ReplayRequest:
    """Find the bundles `specs` name (files, folders, globs) and refuse (usage), before any
    engine, what no replay of them could honour: per-layer outputs of many bundles, and what
    `_refuse_for_a_rank_set` and `_refuse_unusable_arguments` refuse."""
    bundles = find_bundles(specs)
    if options.layers_out is not None and len(bundles) > 1:
        raise UsageError("--save-layers writes one bundle's per-layer outputs: replay one bundle with it")
    opened = OpenedBundle(bundles[0]) if len(bundles) == 1 else None
    request = ReplayRequest(bundles, options, list(engine_argv), keep_going, profile_dir, opened=opened,
                            names=dict(zip(bundles, unique_names(bundles))))
    with contextlib.ExitStack() as closing:
        closing.callback(request.__exit__)
        # of many, each is looked at and let go (a suite reads each again when its turn comes)
        looked_at = [opened] if opened is not None else [_looked_at(bundle) for bundle in bundles]
        request.multi_rank = any(bundle.multi_rank for bundle in looked_at)
        if request.multi_rank:
            _refuse_for_a_rank_set(request)
        _refuse_unusable_arguments(options, [bundle.content_or_none() for bundle in looked_at])
        closing.pop_all()
    return request


def _looked_at(bundle: Path) -> OpenedBundle:
    with OpenedBundle(bundle) as opened:
        return opened


def _refuse_unusable_arguments(options: ReplayOptions, contents: list) -> None:
    """Refuse (usage) `--model` and `--lora` values no replay of these bundles could use: a model
    path that does not exist or is an empty folder, an adapter name no bundle's step ran, an
    adapter path that is not a folder. Every such problem is named, in one line."""
    problems = []
    if options.model is not None:
        model = Path(options.model).expanduser()
        if not model.exists():
            problems.append(f"--model {options.model}: no such file or folder (give where the weights are here)")
        elif model.is_dir() and not any(model.iterdir()):
            problems.append(f"--model {options.model}: an empty folder (give the folder holding the model's weights)")
    named = {adapter.name for content in contents if content is not None for step in content.steps
             for adapter in step.lora_adapters if adapter.name is not None}
    for name, path in options.lora_paths.items():
        if name not in named:
            ran = f"its adapters are {', '.join(sorted(named))}" if named else "it ran no LoRA adapter"
            problems.append(f"--lora {name}={path}: no recorded step ran an adapter named {name!r} ({ran})")
        elif not Path(path).expanduser().is_dir():
            problems.append(f"--lora {name}={path}: no folder there (give the adapter's folder here)")
    if problems:
        raise UsageError("; ".join(problems))


def _refuse_for_a_rank_set(request: ReplayRequest) -> None:
    """Why a multi-rank step cannot be replayed as asked (nothing: it can). It is checked and
    timed as the engine ran it: an option that would change that is refused, never ignored."""
    if len(request.bundles) > 1:
        raise UsageError("a multi-rank step replays on its own: name one rank's bundle "
                         "(tracekit replay step3.rank0.zst), the other ranks' are found from it")
    options, defaults = request.options, ReplayOptions()
    unused = [flag for flag, given in (
        ("--steps", options.step is not None), ("--from", options.from_step is not None),
        ("--mode", options.modes not in ("reference", None)), ("--repeats", options.repeats != defaults.repeats),
        ("--lora", bool(options.lora_paths)), ("--full-engine", options.full_engine),
        ("--save-layers", options.layers_out is not None), ("--profile", request.profile_dir is not None),
    ) if given]
    if unused:
        raise UsageError(f"a multi-rank step is replayed and timed as the engine ran it, which {', '.join(unused)} "
                         "cannot change yet: leave them out")


class Listener(Protocol):
    """Who hears of the bundles as they are replayed (the command's progress and its pipe)."""

    def started(self, position: int, bundle: Path, building: bool, facts: dict[str, Any]) -> None: ...

    def finished(self, record: dict[str, Any]) -> None: ...


@dataclass
class ReplayOutcome:
    """What the replay came to: its exit code, and what to report — a `ReplayResult` or (one
    bundle), a `RankSetReplayResult`, a `SuiteOutcome`, or the record of a replay that broke off
    inside vLLM, the device or tracekit (exit 4: it says nothing yet about the step)."""

    exit_code: int
    report: Any


def carry_out(request: ReplayRequest, listener: Listener) -> ReplayOutcome:
    """Replay what `request` names: a multi-rank step's ranks together, one bundle in detail, or
    a suite, one engine per engine configuration. A single bundle's refusal is raised (after
    its record is heard), with its exit code."""
    from tracekit.integrations.vllm.replay_engine import parse_engine_cli_args

    options = dataclasses.replace(request.options, engine_overrides=parse_engine_cli_args(request.engine_argv))
    if request.multi_rank:  # every rank of one multi-rank step (any rank's bundle): one record
        from tracekit.replay.multirank import replay_rank_set

        listener.started(0, request.opened.path, True, {})
        result = replay_rank_set(request.opened, options)
        listener.finished(result.to_plain())
        return ReplayOutcome(result.exit_code, result)
    if request.opened is not None:
        return _single(request, options, listener)
    from tracekit.replay.suite import run_suite

    outcome = run_suite(
        request.bundles, options, keep_going=request.keep_going, profile_dir=request.profile_dir,
        on_start=lambda position, bundle, building: listener.started(position, bundle, building, {}),
        on_done=lambda record: listener.finished(record.to_plain()), names=request.names,
    )
    return ReplayOutcome(outcome.exit_code, outcome)


def _single(request: ReplayRequest, options: ReplayOptions, listener: Listener) -> ReplayOutcome:
    from tracekit.replay.suite import replay_one

    opened, name = request.opened, request.names[request.bundles[0]]
    facts = opened.facts(options.step)
    listener.started(0, opened.path, True, facts)
    record, _, refusal = replay_one(opened, name, None, request.profile_dir, options)
    result = record.result
    if result is None:  # refused (its record, then the error: one line, its exit code), or crashed
        plain = {**record.to_plain(), "engine_built": False, **facts}  # a lone replay that broke off built none
        listener.finished(plain)
        if refusal is not None:
            raise refusal
        return ReplayOutcome(EXIT_REPLAY_FAILED, plain)
    record.engine = 1
    if result.several:  # one record per step
        for step_record in result.step_records():
            listener.finished({"name": name, "engine": 1, "engine_built": True, "seconds": round(record.seconds, 3),
                               **step_record})
        return ReplayOutcome(result.exit_code, result)
    listener.finished(record.to_plain())
    return ReplayOutcome(record.exit_code, result)

