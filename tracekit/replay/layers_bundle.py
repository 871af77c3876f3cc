"""`tracekit replay B --layers OUT`: the step's per-layer outputs here, as a small bundle.

It is a regular bundle (readable by `inspect`, comparable by `diff`) holding the recorded step's
metadata — requests, input ids, positions, dispatch — with this machine's environment and, as
outputs, only the per-layer outputs of an eager forward. KV blocks and RNG states are left out
(they are what makes a step bundle large). Its tensors are named like those of a bundle
recorded with `tracekit record --layers` (`steps/0/outputs/layers/NAME`), so `tracekit diff`
pairs a layers bundle with another one, or with such a recording, and names the first layer
that parts.
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
