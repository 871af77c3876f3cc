"""Issue 8: whatever breaks inside tracekit — arming on a runner attribute it does not know,
copying a step, a value no bundle can store, a full disk, a dead writer thread, a non-finite
check that cannot be read — the recorder
says why once, disarms itself, and the engine's token ids stay those of an unarmed run; no
partial bundle is left. On both model runners (V2 through the CPU test harness)."""

import pytest
from e2e_support import RUNNER_KINDS, engine_script

from tracekit.format import open_bundle

pytestmark = pytest.mark.slow

STAGES = ("arm", "capture", "unserialisable", "disk_full", "writer_dies", "deferred_check")


@pytest.fixture(scope="module", params=RUNNER_KINDS)
def faults(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"faults-{request.param}")
    result = engine_script("recorder_faults", work / "result.json", work, runner=request.param)
    assert result["runner"] == request.param
    return {**result, "work": work}


def reference(faults, stage):
    return faults["unarmed_with_extra_args" if stage == "unserialisable" else "unarmed"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_failing_recorder_disarms_and_leaves_outputs_unchanged(faults, stage):
    outcome = faults[stage]
    assert outcome["outputs"] == reference(faults, stage)
    assert outcome["failures"], "the failure was not reported"
    assert not outcome["still_armed"], "the recorder kept its shadows on the runner"


@pytest.mark.parametrize("stage", STAGES)
def test_a_failing_recorder_leaves_only_complete_bundles(faults, stage):
    folder = faults["work"] / stage
    outcome = faults[stage]
    assert sorted(outcome["files"]) == sorted(path.rsplit("/", 1)[-1] for path in outcome["written"])
    for name in outcome["files"]:
        with open_bundle(folder / name) as reader:
            assert reader.verify().ok


def test_each_failure_names_its_cause(faults):
    assert "cannot arm" in faults["arm"]["failures"][0]
    assert "attribute_a_later_vllm_renamed" in faults["capture"]["failures"][0]
    assert "extra_args" in faults["unserialisable"]["failures"][0]
    assert "File too large" in faults["disk_full"]["failures"][0]
    assert any("writer thread died" in failure for failure in faults["writer_dies"]["failures"])
    assert "non-finite check cannot be read" in faults["deferred_check"]["failures"][0]
