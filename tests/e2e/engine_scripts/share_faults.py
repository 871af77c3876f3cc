"""A built-in bug for `tracekit shrink` to find: a fault injected into the model forward that
fires only when one request's poison token sits at its poison position in the batch.

  1. engine A, no fault: record the first mixed step (three decodes beside the long request's
     second prefill chunk, which holds the poison position) -> mixed.zst
  2. engine A, no fault: record a window of 3 steps from the first step of the workload (the mixed
     one is its second) -> window.zst; fault "nan": shrink window.zst --until nonfinite on this
     engine, which replays the window's first step bit-exact
  3. engine A, fault "raise": record with --on exception -> raises.zst (the engine is then broken)
  4. engine B, fault "raise": shrink raises.zst --until raises, twice (to raises-small{1,2}.zst)
  5. engine B, fault "nan" (that row's hidden state becomes NaN): shrink mixed.zst --until nonfinite
  6. engine B, no fault: shrink mixed.zst --until nonfinite must refuse and write nothing
  7. engine B, fault "skew" in the eager path only (that row's hidden state + 1e-3 when the
     inner model runs uncompiled): shrink mixed.zst --until modes-differ

Engine B is compiled (the recording engine A is eager, so its failing step can break it
cheaply): modes-differ needs a compiled forward beside the eager one; the other properties are
judged the same in either mode, because their faults sit outside the compiled inner model.

    python share_faults.py RESULT.json WORK_DIR
"""

import sys
from pathlib import Path

from engine_common import eager_llm, write_result

from tracekit.errors import UsageError
from tracekit.integrations.vllm.engines.build import find_runner, release_llm
from tracekit.record.api import recording
from tracekit.share.shrink import shrink

POISON_TOKEN = 499
POISON_POSITION = 70
# Three short prompts and a 100-token one: with 64 tokens a step, step 0 prefills the short ones
# and the long one's first 46 tokens; step 1 runs three decodes beside its tokens 46..99.
SHORT_PROMPTS = [[3 + (5 * i + r) % 60 for i in range(6)] for r in range(3)]
LONG_PROMPT = [100 + (7 * i) % 300 for i in range(100)]
LONG_PROMPT[POISON_POSITION] = POISON_TOKEN
INJECTED_ERROR = f"injected fault: token {POISON_TOKEN} at position {POISON_POSITION}"
SKEW = 1e-3
MODES_TOLERANCE = 1e-5  # far above compiled-vs-eager rounding, far below the skew


def generate(llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in [*SHORT_PROMPTS, LONG_PROMPT]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def inject(model, fault):
    """Shadow `model.forward`: where the poison token is at the poison position, raise, or put a
    NaN into that token's hidden state, or add `SKEW` to it. Returns the undo."""
    original = model.forward

    def forward(*args, **kwargs):
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        hits = ((input_ids == POISON_TOKEN) & (positions == POISON_POSITION)).nonzero().flatten()
        if len(hits) and fault == "raise":
            raise RuntimeError(INJECTED_ERROR)
        output = original(*args, **kwargs)
        if len(hits) and fault in ("nan", "skew"):
            output = output.clone()
            output[hits] = float("nan") if fault == "nan" else output[hits] + SKEW
        return output

    model.forward = forward
    return lambda: model.__dict__.pop("forward", None)


if __name__ == "__main__":
    work = Path(sys.argv[2])
    result = {"poison_token": POISON_TOKEN, "poison_position": POISON_POSITION, "injected_error": INJECTED_ERROR}

    llm = eager_llm()
    with recording(llm, work / "mixed.zst", when="mixed") as recorder:
        generate(llm)
    result["mixed_written"] = [str(p) for p in recorder.written]
    with recording(llm, work / "window.zst", when="num_reqs>=4 and has_prefill", window=3, max_bundles=1) as recorder:
        generate(llm)
    result["window_written"] = [str(p) for p in recorder.written]
    undo = inject(find_runner(llm).model, "nan")
    result["window-nan-small.zst"] = shrink(work / "window.zst", work / "window-nan-small.zst", "nonfinite",
                                            llm=llm).to_plain()
    undo()
    inject(find_runner(llm).model, "raise")
    with recording(llm, work / "raises.zst", on=("exception",)) as recorder:
        try:
            generate(llm)
        except Exception as error:  # the injected fault, as the caller of generate sees it
            result["recording_raised"] = str(error)
    result["raises_written"] = [str(p) for p in recorder.written]
    release_llm(llm)

    llm = eager_llm(enforce_eager=False)
    model = find_runner(llm).model
    undo = inject(model, "raise")
    for name in ("raises-small1.zst", "raises-small2.zst"):
        result[name] = shrink(work / "raises.zst", work / name, "raises", llm=llm).to_plain()
    undo()
    undo = inject(model, "nan")
    result["nan-small.zst"] = shrink(work / "mixed.zst", work / "nan-small.zst", "nonfinite", llm=llm).to_plain()
    undo()
    try:
        shrink(work / "mixed.zst", work / "refused.zst", "nonfinite", llm=llm)
        result["refusal"] = None
    except UsageError as error:
        result["refusal"] = {"message": str(error), "exit_code": error.exit_code}
    result["refused_written"] = (work / "refused.zst").exists()
    # The compiled inner model was traced at start-up; its instance `forward` now runs only when
    # the forward context asks to skip compilation, i.e. in the eager forward.
    undo = inject(model.model, "skew")
    result["modes-small.zst"] = shrink(work / "mixed.zst", work / "modes-small.zst", "modes-differ",
                                       tolerance=MODES_TOLERANCE, llm=llm).to_plain()
    undo()
    write_result(result)
