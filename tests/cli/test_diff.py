"""`tracekit diff` pairs two bundles' tensors by name and says which differ, and by how much."""

import json
from pathlib import Path

from click.testing import CliRunner

from tracekit.cli import main
from tracekit.format.rewrite import rewrite_bundle

SAMPLE = Path(__file__).resolve().parents[2] / "traces" / "tiny-llama-mixed-step.zst"


def _diff(first, second) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["diff", str(first), str(second), "--json"])
    return result.exit_code, json.loads(result.output)


def test_a_bundle_equals_itself():
    code, report = _diff(SAMPLE, SAMPLE)
    assert code == 0 and report["identical_tensors"] and report["metadata"] == []


def test_a_perturbed_tensor_and_a_changed_field_are_named(tmp_path):
    def perturb(metadata, tensors):
        tensors["steps/0/outputs/logits"] = tensors["steps/0/outputs/logits"].clone()
        tensors["steps/0/outputs/logits"][0, 0] += 0.5
        metadata["environment"]["device_name"] = "elsewhere"

    changed = rewrite_bundle(SAMPLE, tmp_path / "changed.zst", perturb)
    code, report = _diff(SAMPLE, changed)
    assert code == 1
    differing = [t for t in report["tensors"] if not t["bit_exact"]]
    assert [t["name"] for t in differing] == ["steps/0/outputs/logits"]
    assert abs(differing[0]["max_abs"] - 0.5) < 1e-6
    assert {"field": "environment.device_name", "first": "x86_64", "second": "elsewhere"} in report["metadata"]


def test_a_tensor_in_one_bundle_only(tmp_path):
    def drop_rng(metadata, tensors):
        del tensors["steps/0/rng/cpu"]
        metadata["steps"][0]["rng"] = {}

    dropped = rewrite_bundle(SAMPLE, tmp_path / "dropped.zst", drop_rng)
    code, report = _diff(SAMPLE, dropped)
    assert code == 1 and report["only_in_first"] == ["steps/0/rng/cpu"]


def test_a_map_that_only_looks_like_a_tensor_reference_is_compared_field_by_field(tmp_path):
    """`{"$tensor": <not a name>}` is plain data to the reader, so to diff as well (one predicate,
    `is_tensor_ref`): its entries are fields like any map's."""
    from tracekit.format import BundleWriter

    for name, value in (("a", 1), ("b", 2)):
        with BundleWriter(tmp_path / f"{name}.zst") as writer:
            writer.set_metadata({"odd": {"$tensor": {"n": value}}, "same": {"$tensor": [0]}})
    code, report = _diff(tmp_path / "a.zst", tmp_path / "b.zst")
    assert code == 0 and report["metadata"] == [{"field": "odd.$tensor.n", "first": 1, "second": 2}]
