"""`tracekit replay B --save-layers OUT`: the step's per-layer outputs here, as a small bundle.

A regular bundle holding the recorded step's metadata with this machine's environment and, as
outputs, only the per-layer outputs of an eager forward (no KV blocks or RNG states: what makes a
bundle large). Its tensors are named as `tracekit record --layers` names them, so `tracekit diff`
pairs it with another such bundle, or with a recording, and names the first layer that parts.
"""

import dataclasses
from pathlib import Path
from typing import Any

from tracekit.format.content import write_steps
from tracekit.format.schema import EngineConfig, Environment, KVSnapshot, Step, StepOutputs, StepTiming


def write_layers_bundle(
    path: str | Path, environment: Environment, engine: EngineConfig, step: Step, layers: dict[str, Any]
) -> Path:
    groups = [
        dataclasses.replace(group, saved_block_ids=[], before={}, after={}) for group in step.kv.groups
    ]
    layers_step = dataclasses.replace(
        step,
        kv=KVSnapshot(mode="none", groups=groups),
        rng={},
        outputs=StepOutputs(layers=dict(layers)),
        timing=StepTiming(),
        extras={**step.extras, "layers_from": "eager replay (tracekit replay --layers)"},
    )
    return write_steps(Path(path), environment, engine, [layers_step])
