"""Issue 9: `tracekit inspect` shows the recording machine's numerics-relevant environment, and
`--json --full` dumps the whole recorded content as plain JSON, on the bundle from the AVX2
machine in traces/."""

import json
from pathlib import Path

from click.testing import CliRunner

from tracekit.cli import main
from tracekit.format import open_bundle

AVX2_BUNDLE = Path(__file__).resolve().parents[2] / "traces" / "avx2-mixed-step.zst"


def test_inspect_names_the_recording_cpu_isa():
    result = CliRunner().invoke(main, ["inspect", str(AVX2_BUNDLE)])
    assert result.exit_code == 0, result.output
    assert "numerics: cpu x86_64 | cpu_isa AVX2" in result.output
    summary = json.loads(CliRunner().invoke(main, ["inspect", str(AVX2_BUNDLE), "--json"]).output)
    assert summary["numerics"]["cpu_isa"] == "AVX2" and "content" not in summary


def test_inspect_full_dumps_the_scheduler_output_and_request_states_with_tensor_summaries():
    result = CliRunner().invoke(main, ["inspect", str(AVX2_BUNDLE), "--json", "--full"])
    assert result.exit_code == 0, result.output
    step = json.loads(result.output)["content"]["steps"][0]
    with open_bundle(AVX2_BUNDLE) as reader:
        recorded = reader.metadata["steps"][0]
        infos = {info.name: info for info in reader.tensor_infos()}
    assert step["scheduler_output"] == recorded["scheduler_output"]  # plain data, unchanged
    assert step["scheduler_output"]["$type"] == "SchedulerOutput"
    assert [r["req_id"] for r in step["requests"]] == recorded["batch_order"]
    ids = infos["steps/0/input_ids"]
    assert step["input_ids"] == {"tensor": "steps/0/input_ids", "dtype": ids.dtype, "shape": list(ids.shape)}


def test_full_without_json_is_a_usage_error():
    result = CliRunner().invoke(main, ["inspect", str(AVX2_BUNDLE), "--full"])
    assert result.exit_code == 2 and "--json" in result.output
