"""Sampled ids come from async outputs read after the next step has started.

On GPUs vLLM schedules asynchronously: step N+1's `execute_model` runs before step N's async
output is read. Model Runner V2's `sample_tokens` always returns its async output type
(`AsyncOutput`), so on this CPU the order can be driven directly on the real runner: two steps
(the built-in workload's first step, then its first request alone under another id),
each executed and sampled, their outputs read afterwards in reverse order, with a recorder armed
on every step.

    python async_outputs.py RESULT.json WORK_DIR
"""

import sys
from pathlib import Path

from engine_common import eager_llm, write_result

from tracekit.format.content import load_step
from tracekit.integrations.vllm.engines.build import adapter_of
from tracekit.record import workload
from tracekit.record.api import recording

if __name__ == "__main__":
    work = Path(sys.argv[2])
    llm = eager_llm()
    adapter = adapter_of(llm)
    runner = adapter.runner
    with recording(llm, f"{work}/first{{step}}.zst", steps="0") as first:
        workload.run_workload(llm, workload.BUILTIN_WORKLOAD[:2], 2)
    _, step = load_step(first.written[0], None)
    llm.reset_prefix_cache()

    schedules = [adapter.scheduler_output_for(step)]
    # The second step: its first request alone, renamed (so the two outputs differ in shape).
    step.requests = [request for request in step.requests if request.req_id == step.batch_order[0]]
    step.requests[0].req_id += "-again"
    step.batch_order = [step.requests[0].req_id]
    schedules.append(adapter.scheduler_output_for(step))

    with recording(llm, f"{work}/async{{step}}.zst", steps="0:") as recorder:
        outputs = []
        for schedule in schedules:
            runner.execute_model(schedule)
            outputs.append(runner.sample_tokens(None))
        kinds = [type(output).__name__ for output in outputs]
        read = {index: outputs[index].get_output().sampled_token_ids for index in (1, 0)}
        runner.execute_model(adapter.release.finishing_output([*schedules[0].num_scheduled_tokens,
                                                                    *schedules[1].num_scheduled_tokens]))
    write_result({
        "output_types": kinds,
        "read": [read[0], read[1]],
        "written": [str(path) for path in recorder.written],
        "failures": recorder.failures,
    })
