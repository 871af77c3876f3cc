"""vLLM objects survive the trip to plain msgpack data and back, field by field, with the
installed vLLM's classes; what cannot be stored, or rebuilt safely, is refused by name."""

import msgpack
import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402

from tracekit.errors import BundleError  # noqa: E402
from tracekit.format.schema import SchedulerOutputRecord  # noqa: E402
from tracekit.integrations.vllm.records.serialize import (  # noqa: E402
    SerializationError,
    to_plain,
    to_versioned_plain,
)
from tracekit.integrations.vllm.releases.installed import installed_release  # noqa: E402


def _scheduler_output() -> SchedulerOutput:
    params = SamplingParams(
        temperature=0.8, seed=7, logit_bias={5: 1.5, 9: -2.0}, max_tokens=4,
        output_kind=RequestOutputKind.DELTA, stop_token_ids=[3],
    )
    new = NewRequestData(
        req_id="r0", prompt_token_ids=[1, 2, 3], mm_features=[], sampling_params=params,
        pooling_params=None, block_ids=([4, 5],), num_computed_tokens=0, lora_request=None,
    )
    cached = CachedRequestData(
        req_ids=["r1"], resumed_req_ids={"r1"}, new_token_ids=[[]], all_token_ids={},
        new_block_ids=[([7],)], num_computed_tokens=[40], num_output_tokens=[2],
    )
    output = SchedulerOutput(
        scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
        num_scheduled_tokens={"r0": 3, "r1": 1}, total_num_scheduled_tokens=4,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids={"old-b", "old-a"}, free_encoder_mm_hashes=[],
    )
    output.new_block_ids_to_zero = [5, 7]
    return output


def test_scheduler_output_round_trips_through_msgpack():
    original = _scheduler_output()
    plain = msgpack.unpackb(msgpack.packb(to_plain(original)), strict_map_key=False)
    rebuilt = installed_release().from_plain(plain)

    assert isinstance(rebuilt, SchedulerOutput)
    assert rebuilt.finished_req_ids == {"old-a", "old-b"}
    assert rebuilt.num_scheduled_tokens == {"r0": 3, "r1": 1}
    assert rebuilt.new_block_ids_to_zero == [5, 7]
    new = rebuilt.scheduled_new_reqs[0]
    assert new.block_ids == ([4, 5],) and isinstance(new.block_ids, tuple)
    assert rebuilt.scheduled_cached_reqs.resumed_req_ids == {"r1"}
    assert rebuilt.scheduled_cached_reqs.new_block_ids == [([7],)]
    params, expected = new.sampling_params, original.scheduled_new_reqs[0].sampling_params
    for name in expected.__struct_fields__:
        assert getattr(params, name) == getattr(expected, name), name
    assert params.output_kind is RequestOutputKind.DELTA
    assert params.logit_bias == {5: 1.5, 9: -2.0}
    assert params.sampling_type == expected.sampling_type


def test_the_vllm_version_tag_rides_along_and_is_ignored_on_rebuild():
    plain = to_versioned_plain(_scheduler_output(), "0.32.0")
    assert plain["$vllm_version"] == "0.32.0" and plain["$type"] == "SchedulerOutput"
    assert installed_release().from_plain(plain).total_num_scheduled_tokens == 4


def test_private_and_default_sampling_fields_are_kept():
    plain = to_plain(SamplingParams(stop_token_ids=[3, 4]))
    assert plain["_all_stop_token_ids"] == {"$set": [3, 4]}
    assert plain["n"] == 1


def test_tensors_stay_tensors_as_host_copies():
    tensor = torch.arange(4)
    plain = to_plain({"x": tensor})
    assert torch.equal(plain["x"], tensor) and plain["x"].data_ptr() != tensor.data_ptr()


def test_a_token_array_becomes_its_list_of_ids():
    """vLLM 0.34 hands the runner prompt ids as `TokenBuffer`, an int32 `array.array` subclass
    whose own `tolist` and slicing are overridden."""
    import array

    class TokenBuffer(array.array):
        def tolist(self):
            return "not the ids"

    plain = to_plain({"prompt_token_ids": TokenBuffer("i", [5, 6, 7])})
    assert plain == {"prompt_token_ids": [5, 6, 7]}
    assert all(type(token) is int for token in plain["prompt_token_ids"])


def test_an_unknown_object_is_refused_with_its_path():
    with pytest.raises(SerializationError, match=r"value\.weird: unsupported type object"):
        to_plain({"weird": object()})


@pytest.mark.parametrize(
    "plain",
    [{"$type": "Popen", "args": ["rm"]}, {"$enum": "Signals", "value": 9}, {"$type": 5}],
)
def test_only_allow_listed_vllm_types_are_rebuilt(plain):
    with pytest.raises(BundleError, match="does not rebuild"):
        installed_release().from_plain(plain)


def test_a_new_requests_lora_request_round_trips_and_a_value_vllm_refuses_is_the_bundles_fault():
    """`LoRARequest` has fields without defaults and checks its values: a window's later step
    carries it in a new request."""
    from vllm.lora.request import LoRARequest

    plain = to_plain(LoRARequest(lora_name="b", lora_int_id=2, lora_path="/adapters/b"))
    rebuilt = installed_release().from_plain(plain)
    assert (rebuilt.lora_name, rebuilt.lora_int_id, rebuilt.lora_path) == ("b", 2, "/adapters/b")
    for edit, problem in (({"lora_int_id": 0}, "refused by vLLM: id must be > 0"),
                          ({"lora_path": ""}, "refused by vLLM")):
        with pytest.raises(BundleError, match=problem):
            installed_release().from_plain({**plain, **edit})
    with pytest.raises(BundleError, match="lacks lora_name"):
        installed_release().from_plain({key: value for key, value in plain.items() if key != "lora_name"})


def test_a_field_another_release_recorded_is_left_out_when_empty_and_refused_otherwise():
    """A bundle of another vLLM release may hold fields this vLLM's classes lack: empty ones (the
    feature they belong to was off) are left out; one that was in use is refused (exit 3),
    naming it, since this vLLM cannot do what it asked."""
    from tracekit.errors import CannotRunHere

    plain = to_plain(SamplingParams(temperature=0.5))
    rebuilt = installed_release().from_plain({**plain, "trace_decode_token_ids": None, "stream_interval": 0,
                                              "future_flags": {"$set": []}})
    assert rebuilt.temperature == 0.5
    with pytest.raises(CannotRunHere, match=r"SamplingParams\.future_feature is \[1, 2\], a field this vLLM"):
        installed_release().from_plain({**plain, "future_feature": [1, 2]})


def test_engine_arguments_of_another_release_are_adopted_or_refused_by_name():
    """vLLM 0.26 records `calculate_kv_scales` (False), which 0.28 and later lack."""
    from tracekit.errors import CannotRunHere

    release = installed_release()
    recorded = {"model": "m", "calculate_kv_scales": False, "compilation_config": {"mode": 0, "gone_field": None}}
    assert release.adopt_engine_args(recorded) == {"model": "m", "compilation_config": {"mode": 0}}
    with pytest.raises(CannotRunHere, match="engine argument calculate_kv_scales=True"):
        release.adopt_engine_args({**recorded, "calculate_kv_scales": True})


def test_a_034_step_s_split_capture_sizes_give_way_to_their_union_under_an_older_release():
    """vLLM 0.34 records prefill and decode capture sizes apart and `cudagraph_capture_sizes` as
    their union (traces/h200-vllm034-greedy, H200): an older release takes the union. Under 0.26
    on an H100 those steps were refused, as a field it lacks, before this."""
    from pathlib import Path

    from tracekit.errors import CannotRunHere
    from tracekit.format.content import load_step

    bundle = Path(__file__).resolve().parents[2] / "traces" / "h200-vllm034-greedy" / "mixed.zst"
    content, _ = load_step(bundle, None)
    recorded = content.engine.engine_args
    split = {"prefill_cudagraph_capture_token_sizes", "decode_cudagraph_capture_request_sizes"}
    assert split <= recorded["compilation_config"].keys()
    release = installed_release()
    adopted = release.adopt_engine_args(recorded)["compilation_config"]
    assert adopted["cudagraph_capture_sizes"] == recorded["compilation_config"]["cudagraph_capture_sizes"]
    assert not split & adopted.keys()
    union_gone = {**recorded, "compilation_config": {k: v for k, v in recorded["compilation_config"].items()
                                                     if k != "cudagraph_capture_sizes"}}
    with pytest.raises(CannotRunHere, match="compilation_config field (prefill|decode)_cudagraph"):
        release.adopt_engine_args(union_gone)  # nothing here to take their place


def test_the_typed_record_of_a_scheduler_output_gives_vllm_the_same_object():
    """Typed once when a bundle is read, and written back as it was read: the record of a recorded
    scheduler output holds the same map, field order included, and rebuilds the same vLLM object."""
    plain = to_versioned_plain(_scheduler_output(), "0.32.0")
    record = SchedulerOutputRecord.from_plain(plain)
    assert list(record.to_plain().items()) == list(plain.items())
    assert record.scheduled_new_reqs[0].sampling_params.seed == 7 and record.finished_req_ids == ["old-a", "old-b"]
    release = installed_release()
    assert release.from_plain(record) == release.from_plain(plain)

