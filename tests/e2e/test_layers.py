"""Issue 9: per-layer outputs. `tracekit record --layers` stores every decoder layer's output (and
its norms, attention, MLP) of the recorded step; a replay checks them against its own eager
forward and names the first layer that diverges; `tracekit replay --save-layers OUT` writes them as
a small bundle that `tracekit diff` compares layer by layer."""

import json
from pathlib import Path

import pytest
import torch
from e2e_support import read_step, tracekit

from tracekit.format.rewrite import rewrite_bundle
from tracekit.models import tiny_model_path

pytestmark = pytest.mark.slow

NUM_LAYERS = json.loads((Path(tiny_model_path()) / "config.json").read_text())["num_hidden_layers"]
LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@pytest.fixture(scope="module")
def layered_bundle(tmp_path_factory):
    """The built-in workload's first mixed step, eager, recorded with its layers."""
    out = tmp_path_factory.mktemp("layers") / "mixed.zst"
    finished = tracekit("record", "--enforce-eager", "--layers", "-o", out)
    assert finished.returncode == 0, finished.explain()
    return out


def base_name(name: str) -> str:
    return name.split("[")[0]  # "model.layers.0.post_attention_layernorm[1]" -> its module


def test_every_layer_and_its_parts_are_recorded_in_forward_order(layered_bundle):
    names = [base_name(name) for name in read_step(layered_bundle).outputs.layers]
    for index in range(NUM_LAYERS):
        parts = [names.index(f"model.layers.{index}.{part}") for part in LAYER_PARTS]
        assert parts == sorted(parts), names
        assert max(parts) < names.index(f"model.layers.{index}")  # a layer returns after its parts
    assert names[0] == "model.embed_tokens" and names[-1] == "model.norm"


def test_replay_checks_the_recorded_layers_and_writes_its_own(layered_bundle, tmp_path):
    layers_out, result_path = tmp_path / "layers-here.zst", tmp_path / "result.json"
    finished = tracekit("replay", layered_bundle, "--no-timing", "--save-layers", layers_out, "--json", result_path)
    assert finished.returncode == 0, finished.explain()
    result = json.loads(result_path.read_text())
    assert result["verdict"] == "bit_exact" and result["first_diverging_layer"] is None
    recorded = read_step(layered_bundle).outputs.layers
    assert [check["item"] for check in result["layer_checks"]] == [f"layer/{name}" for name in recorded]
    assert all(check["bit_exact"] for check in result["layer_checks"])
    # The replay's layers bundle pairs with the recording, tensor for tensor, and holds no KV.
    diffed = tracekit("diff", layered_bundle, layers_out, "--json")
    comparison = json.loads(diffed.stdout)
    layer_tensors = [t for t in comparison["tensors"] if "/outputs/layers/" in t["name"]]
    assert len(layer_tensors) == len(recorded) and comparison["first_difference"] is None
    assert all("/kv/" in name or "/rng/" in name or "/outputs/" in name for name in comparison["only_in_first"])
    assert layers_out.stat().st_size < layered_bundle.stat().st_size


def test_the_first_diverging_layer_is_named(layered_bundle, tmp_path):
    """One ulp changed in the recorded output of layer 1's MLP: every module before it still
    matches, so that MLP is the first diverging layer, and on the recording's own platform the
    verdict is diverged."""
    target = f"model.layers.{NUM_LAYERS - 1}.mlp"

    def nudge(metadata, tensors):
        values = tensors[f"steps/0/outputs/layers/{target}"].view(-1)
        values[0] = torch.nextafter(values[0], torch.tensor(float("inf")))

    edited = rewrite_bundle(layered_bundle, tmp_path / "nudged.zst", nudge)
    result_path = tmp_path / "result.json"
    finished = tracekit("replay", edited, "--no-timing", "--json", result_path)
    assert finished.returncode == 1, finished.explain()
    result = json.loads(result_path.read_text())
    assert result["verdict"] == "diverged" and result["first_diverging_layer"] == target
    assert f"first diverging layer {target}" in finished.stdout
    assert all(check["bit_exact"] for check in result["checks"])  # the step's own items still match
