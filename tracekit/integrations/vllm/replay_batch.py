"""Turning a recorded step's request states back into `SchedulerOutput`s a runner accepts.

The rebuilt engine's scheduler never saw the recorded requests, so each of them arrives as new,
with its recorded prompt, computed tokens and block ids; `prefill_token_ids` carries prompt and
outputs, which Model Runner V2 reads (V1 ignores it and gets its outputs back through its adapter).
"""

from typing import Any

from tracekit.format.schema import Step
from tracekit.integrations.vllm.serialize import from_plain


def new_requests_output(step: Step) -> Any:
    """The step's requests, all new, scheduled in the recorded batch order."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    by_id = {request.req_id: request for request in step.requests}
    new_requests = [
        NewRequestData(
            req_id=req_id,
            prompt_token_ids=list(by_id[req_id].prompt_token_ids),
            mm_features=[],
            sampling_params=from_plain(by_id[req_id].sampling_params),
            pooling_params=None,
            block_ids=tuple(list(ids) for ids in by_id[req_id].block_ids),
            num_computed_tokens=by_id[req_id].num_computed_tokens,
            lora_request=None,
            prefill_token_ids=[*by_id[req_id].prompt_token_ids, *by_id[req_id].output_token_ids],
        )
        for req_id in step.batch_order
    ]
    scheduled = {req_id: by_id[req_id].num_scheduled_tokens for req_id in step.batch_order}
    return SchedulerOutput(
        scheduled_new_reqs=new_requests,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def finishing_output(req_ids: list[str]) -> Any:
    """An empty step that finishes `req_ids` in the runner, leaving it able to serve."""
    from vllm.v1.core.sched.output import SchedulerOutput

    finish = SchedulerOutput.make_empty()
    finish.finished_req_ids = set(req_ids)
    return finish
