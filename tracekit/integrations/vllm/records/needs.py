"""What a bundle needs of the machine that replays it, read from its recording, said in one line:
the receiving team's first question is whether their machine can replay the bundle, and how.
`tracekit inspect` and every replay report open with it. It reads the recording only (no torch,
no vLLM): it says what the bundle needs, not whether this machine has it.
"""

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tracekit.format.schema import BundleContent, Step
from tracekit.integrations.vllm.records.weights import weights_fingerprint
from tracekit.models import tiny_model_path


@dataclass(frozen=True)
class BundleNeeds:
    vllm_series: str | None
    device: str  # "cpu", "cuda", "npu"
    device_name: str | None
    compute_capability: str | None  # a GPU's ("sm_90"), or a CPU's ISA ("AVX512")
    runner: str  # vLLM's model runner: "v1" or "v2"
    graph_mode: str  # "eager" or "compiled", and the graph the step was dispatched to
    dtype: str | None
    model: str
    fingerprint: str | None
    not_fingerprinted: str | None  # why there is no fingerprint (None when there is one)
    lora_adapters: list[str] = field(default_factory=list)  # "NAME (how a replay finds it)"
    command: str = ""

    def line(self) -> str:
        """`needs: vLLM 0.32 | cpu AVX512 | V1 runner, eager | float32 | model M (fingerprint) |
        no LoRA | run: tracekit replay B`."""
        device = " ".join(part for part in (self.device, self.device_name, self.compute_capability) if part)
        model = f"{self.model} ({self.fingerprint or 'not fingerprinted: ' + str(self.not_fingerprinted)})"
        adapters = "LoRA " + ", ".join(self.lora_adapters) if self.lora_adapters else "no LoRA"
        parts = (f"vLLM {self.vllm_series or 'unknown'}", device, f"{self.runner.upper()} runner, {self.graph_mode}",
                 self.dtype or "dtype unknown", f"model {model}", adapters, f"run: {self.command}")
        return "needs: " + " | ".join(parts)

    def to_plain(self) -> dict[str, Any]:
        return asdict(self)


def bundle_needs(content: BundleContent, bundle: str | Path) -> BundleNeeds:
    """What `bundle` (its `content`) needs to replay."""
    engine, environment = content.engine, content.environment
    step = content.steps[0] if content.steps else None
    fingerprint = engine.model.weights_fingerprint
    adapters = step.lora_adapters if step is not None else []
    dtype = engine.engine_args.get("dtype")  # as the recorder resolved it
    command = [f"tracekit replay {bundle}"]
    # vLLM's dummy weights, and tracekit's own tiny model (found by its fingerprint), need no folder
    if fingerprint not in ("dummy", weights_fingerprint(tiny_model_path(), None)):
        command.append(f"[--model DIR, where the weights are not at {engine.model.path}]")
    command += [f"[--lora {adapter.name}=DIR]" for adapter in adapters if not adapter.files]
    return BundleNeeds(
        vllm_series=series_of(engine.vllm_version) if engine.vllm_version else None,
        device=environment.device_kind,
        device_name=environment.device_name if environment.device_kind != "cpu" else None,
        compute_capability=environment.gpu_capability or environment.cpu_isa,
        runner=engine.runner,
        graph_mode=_graph_mode(step),
        dtype=str(dtype) if dtype else None,
        model=engine.model.path,
        fingerprint=fingerprint,
        not_fingerprinted=None if fingerprint is not None else (
            "its weights were in no local folder when recorded (a hub id an older tracekit did not resolve), so a "
            "replay cannot check it finds the same ones"),
        lora_adapters=[_adapter(adapter) for adapter in adapters],
        command=" ".join(command),
    )


def series_of(version: str) -> str:
    """`0.26.0+cu130` -> `0.26`."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _graph_mode(step: Step | None) -> str:
    if step is None:
        return "no step"
    compiled = "eager" if step.graph.compilation_mode == "NONE" else "compiled"
    if step.graph.runtime_mode == "NONE":
        return compiled
    return f"{compiled}, {step.graph.runtime_mode} graph of {step.graph.num_tokens_padded} rows"


def _adapter(adapter) -> str:
    found = "kept in the bundle" if adapter.files else (adapter.fingerprint or "no fingerprint")
    return f"{adapter.name or adapter.int_id} ({found})"
