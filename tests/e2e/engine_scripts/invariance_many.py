"""`tracekit invariance` on ONE eager engine of the default configuration: first record a
prefix-cache hit small enough to recompute within the engine's 64-token steps (a 32-token
shared prefix: one full KV block), then check every bundle given and that hit step.

    python invariance_many.py RESULT.json OUT_DIR BUNDLE [BUNDLE ...]

Writes {"reports": {bundle: InvarianceReport.to_plain() or {"error": ...}}, "prefix_hit": path}.
"""

import sys
from pathlib import Path

from engine_common import eager_llm, generate_token_ids, write_result

from tracekit.record.api import recording
from tracekit.share.invariance import check_invariance

SHARED_PREFIX = [3 + (7 * i) % 500 for i in range(32)]


def record_prefix_hit(llm, out_dir: Path) -> Path:
    from vllm.inputs import TokensPrompt

    generate_token_ids(llm, [TokensPrompt(prompt_token_ids=SHARED_PREFIX + [400, 401, 402])], [{"temperature": 0.0}], 2)
    with recording(llm, str(out_dir / "hit.zst"), when="has_prefill") as recorder:
        generate_token_ids(llm, [TokensPrompt(prompt_token_ids=SHARED_PREFIX + [410, 411, 412, 413])],
                           [{"temperature": 0.0}], 2)
    (written,) = recorder.written
    return Path(written)


if __name__ == "__main__":
    out_dir, bundles = Path(sys.argv[2]), sys.argv[3:]
    llm = eager_llm()
    hit = record_prefix_hit(llm, out_dir)
    result = {"prefix_hit": str(hit), "reports": {}}
    for bundle in [*bundles, str(hit)]:
        try:
            result["reports"][bundle] = check_invariance(bundle, llm=llm).to_plain()
        except Exception as error:  # reported per bundle; the test names what failed
            result["reports"][bundle] = {"error": f"{type(error).__name__}: {error}"}
    write_result(result)
