"""The ids a client of vLLM's OpenAI server sees, matched exactly to the ids its engine gives
requests (docs/GUIDE.md, "Request triggers"). A client knows its request by the response's `id`,
or by the `X-Request-Id` header (or the body's `request_id`) the server takes as its base; the
engine derives its own id from that (in every supported series: `Release.client_request_matcher`):

    /v1/completions        response id  cmpl-<base>          per prompt i: cmpl-<base>-<i>
    /v1/chat/completions   response id  chatcmpl-<base>      several inputs: chatcmpl-<base>_<i>
    the engine (`InputProcessor.assign_request_id`) adds `-` and 8 random hex digits, unless
                           VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set
    parallel sampling (n > 1) names each child `<k>_` + the parent's internal id

A bare id (a header's value) matches the requests of either endpoint with that base; an id that
starts with an endpoint's prefix is also taken as a header's value (a client may send
`X-Request-Id: cmpl-x`, whose response id is `cmpl-cmpl-x`).
"""

import re
from typing import Callable

# response-id prefix -> what follows the response id in the engine's request id (before the random suffix)
_ENDPOINTS = {
    "cmpl": r"-\d+",  # the prompt's index, always
    "chatcmpl": r"(?:_\d+)?",  # the input's index, only where the request had several
}
_RANDOM_SUFFIX = r"-[0-9a-f]{8}"
_CHILD_PREFIX = r"(?:\d+_)?"


def client_id_matcher(client_id: str, randomized: bool) -> Callable[[str], bool]:
    """Whether an engine request id is one of the requests a client knows as `client_id`;
    `randomized`: the engine adds its random suffix (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION unset)."""
    suffix = _RANDOM_SUFFIX if randomized else ""
    forms = []
    for prefix, index in _ENDPOINTS.items():
        forms.append(re.escape(f"{prefix}-{client_id}") + index)  # a header's value
        if client_id.startswith(f"{prefix}-"):
            forms.append(re.escape(client_id) + index)  # the response's id
    pattern = re.compile(f"{_CHILD_PREFIX}(?:{'|'.join(forms)}){suffix}")
    return lambda req_id: pattern.fullmatch(req_id) is not None
