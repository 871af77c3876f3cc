"""When the recorder fires: by step index, by a predicate on the batch, on exception, on
non-finite outputs. Step and predicate triggers are decided before the forward from cheap batch
facts, so an armed recorder that does not fire costs one comparison per step; exception and
non-finite triggers decide after it (`capture_kinds` says how a step is kept until then).

Predicates are a tiny language, parsed here and never evaluated as Python (its names: docs/GUIDE.md,
"Recording" and "Request triggers"; a request's engine ids are matched as
`tracekit.integrations.vllm.records.request_ids` derives them):

    clause ("and" clause)*      clause = NAME | NAME OP VALUE      OP = == != >= <= > <
"""

import operator
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable

from tracekit.errors import UsageError
from tracekit.integrations.seam import BatchFacts, RequestProgress

_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
_CLAUSE = re.compile(r"^\s*([a-z_]+)\s*(?:(==|!=|>=|<=|>|<)\s*([^\s<>=!]+))?\s*$")
_INT_FACTS = ("num_reqs", "num_tokens", "num_prefills", "num_decodes")
_BOOL_FACTS = ("has_prefill", "has_decode", "mixed")
_REQUEST = "request"
_REQUEST_INT_FACTS = ("generated",)
_REQUEST_BOOL_FACTS = ("first_chunk",)
_KNOWN = (*_INT_FACTS, *_BOOL_FACTS, "req_id", _REQUEST, *_REQUEST_INT_FACTS, *_REQUEST_BOOL_FACTS)


@dataclass(frozen=True)
class SettingNames:
    """How the user spelled each recording setting, for the messages that name one: the CLI's
    flags, the vLLM plugin's environment variables, or the live-control route's fields."""

    steps: str = "--steps"
    when: str = "--when"
    on: str = "--on"
    kv: str = "--kv"
    max_bundles: str = "--max-bundles"
    window: str = "--window"
    output: str = "-o"


CLI_NAMES = SettingNames()


class TriggerEvent(str, Enum):
    """Triggers decided after the forward, by what happened in the step."""

    EXCEPTION = "exception"  # the step raised (in any phase)
    NONFINITE = "nonfinite"  # its hidden states or logits hold NaN or inf


EVENT_TRIGGERS = tuple(event.value for event in TriggerEvent)

# The most bundles one recording writes where its output takes every firing step (`{step}`).
DEFAULT_MAX_BUNDLES = 16


def parse_steps(text: str, name: str = CLI_NAMES.steps) -> Callable[[int], bool]:
    """`7`, `5:9` (5 to 8, as a Python slice), `3,7,10:12`, `5:` (5 onwards); `name`: the
    setting as the user spelled it."""
    tests: list[Callable[[int], bool]] = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)?(:)?(\d+)?", part)
        if not part or not match or (match.group(2) is None and match.group(3) is not None):
            raise UsageError(f"bad {name} {text!r}: use an index (7), a range (5:9) or a list (3,7)")
        start, is_range, stop = match.groups()
        if not is_range:
            tests.append(lambda index, at=int(start): index == at)
            continue
        low, high = int(start or 0), int(stop) if stop is not None else None
        if high is not None and high <= low:
            raise UsageError(f"bad {name} {text!r}: empty range {part}")
        tests.append(lambda index, low=low, high=high: index >= low and (high is None or index < high))
    return lambda index: any(test(index) for test in tests)


@dataclass(frozen=True)
class Predicate:
    """A parsed `--when`: clauses on the batch, and where it names a request (`request==ID`),
    clauses on that request's progress, one of its engine requests in the step meeting them all."""

    batch: tuple[Callable[[BatchFacts], bool], ...]
    request: str | None = None  # the client's id of request==ID
    of_request: tuple[Callable[[RequestProgress], bool], ...] = ()

    def holds(self, facts: Callable[[], BatchFacts], requests: Callable[[], Iterable[RequestProgress]]) -> bool:
        """Whether the step meets every clause; `requests()`: the progress of each engine
        request of the step that `request==ID` names (asked first: most steps have none)."""
        if self.request is not None and not any(
            all(clause(progress) for clause in self.of_request) for progress in requests()
        ):
            return False
        if not self.batch:
            return True
        batch = facts()
        return all(clause(batch) for clause in self.batch)


def parse_predicate(text: str, name: str = CLI_NAMES.when) -> Predicate:
    batch, of_request, requests = [], [], []
    for clause in re.split(r"\s+and\s+", text.strip()):
        fact, test = _parse_clause(clause, text, name)
        if fact == _REQUEST:
            requests.append(test)
        elif fact in _REQUEST_INT_FACTS + _REQUEST_BOOL_FACTS:
            of_request.append(test)
        else:
            batch.append(test)
    if len(requests) > 1:
        raise UsageError(f"bad {name} {text!r}: name one request (one request==ID)")
    if of_request and not requests:
        raise UsageError(f"bad {name} {text!r}: {', '.join(_REQUEST_BOOL_FACTS + _REQUEST_INT_FACTS)} are about "
                         "the request named by request==ID: add one")
    return Predicate(tuple(batch), requests[0] if requests else None, tuple(of_request))


def _parse_clause(clause: str, whole: str, setting: str) -> tuple[str, Any]:
    """The fact a clause reads and its test (for `request`: the client's id)."""
    bad = f"bad {setting} {whole!r}"
    match = _CLAUSE.match(clause)
    if not match:
        raise UsageError(f"{bad}: cannot read {clause!r} (use e.g. 'num_reqs>=2 and has_prefill')")
    name, op, value = match.groups()
    if name not in _KNOWN:
        raise UsageError(f"{bad}: unknown name {name!r} (known: {', '.join(_KNOWN)})")
    if name in _BOOL_FACTS + _REQUEST_BOOL_FACTS:
        if op is not None:
            raise UsageError(f"{bad}: {name} is a flag, use it alone")
        return name, lambda facts: getattr(facts, name)
    if op is None:
        raise UsageError(f"{bad}: {name} needs a comparison, e.g. {name}>=2")
    if name == _REQUEST:
        if op != "==":
            raise UsageError(f"{bad}: request takes ==, e.g. request==cmpl-99a6ae51716401f0")
        return name, value.strip("'\"")
    if name == "req_id":
        if op not in ("==", "!="):
            raise UsageError(f"{bad}: req_id takes == or !=")
        wanted = value.strip("'\"")
        return name, lambda facts: (wanted in facts.req_ids) == (op == "==")
    if not re.fullmatch(r"-?\d+", value):
        raise UsageError(f"{bad}: {name} compares with a whole number, not {value!r}")
    compare, number = _OPERATORS[op], int(value)
    return name, lambda facts: compare(getattr(facts, name), number)


class RequestWatch:
    """The engine requests a `request==ID` trigger names, picked from each step's requests by
    a matcher of engine ids (the engine's own derivation of them); each id is matched once."""

    _MOST_KEPT = 1 << 16  # decided ids kept before they are forgotten (finished requests' ids pile up)

    def __init__(self, matches: Callable[[str], bool]):
        self._matches = matches
        self._decided: dict[str, bool] = {}

    def named(self, req_ids: Iterable[str]) -> list[str]:
        decided, named = self._decided, []
        for req_id in req_ids:
            match = decided.get(req_id)
            if match is None:
                if len(decided) >= self._MOST_KEPT:
                    decided.clear()
                match = decided[req_id] = self._matches(req_id)
            if match:
                named.append(req_id)
        return named


@dataclass
class TriggerSet:
    """All armed triggers; `fires_before_forward` names what fired for the bundle's `trigger`
    field (events name themselves). `names`: how the user spelled the settings, for refusals."""

    steps: str | None = None
    when: str | None = None
    events: tuple[str, ...] = ()
    names: SettingNames = CLI_NAMES
    _step_test: Callable[[int], bool] | None = field(default=None, repr=False)
    _predicate: Predicate | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        unknown = [event for event in self.events if event not in EVENT_TRIGGERS]
        if unknown:
            raise UsageError(f"bad {self.names.on}: unknown trigger {unknown[0]!r} (known: {', '.join(EVENT_TRIGGERS)})")
        self.events = tuple(TriggerEvent(event) for event in self.events)
        if self.steps is not None:
            self._step_test = parse_steps(self.steps, self.names.steps)
        if self.when is not None:
            self._predicate = parse_predicate(self.when, self.names.when)
        if self.steps is None and self.when is None and not self.events:
            raise UsageError(f"nothing to record: give {self.names.steps}, {self.names.when} or "
                             f"{self.names.on} exception/nonfinite")

    @property
    def request(self) -> str | None:
        """The client's id a `request==ID` clause names, if one does."""
        return self._predicate.request if self._predicate is not None else None

    def describe(self) -> str:
        """The triggers in words, as the user gave them."""
        parts = [f"steps {self.steps}"] if self.steps is not None else []
        parts += [f"when {self.when}"] if self.when is not None else []
        parts += [f"on {','.join(event.value for event in self.events)}"] if self.events else []
        return " ".join(parts)

    def fires_before_forward(self, index: int, facts: Callable[[], BatchFacts],
                             requests: Callable[[], Iterable[RequestProgress]] = tuple) -> str | None:
        """The reason this step is recorded, decided before its forward; None if it is not.
        `facts` is only called when a predicate needs them; `requests` (the progress of the
        step's requests `request==ID` names) only when it names one."""
        if self._step_test is not None:
            if not self._step_test(index):
                return None
            if self._predicate is None:
                return f"steps {self.steps}"
            return f"steps {self.steps} when {self.when}" if self._predicate.holds(facts, requests) else None
        if self._predicate is not None and self._predicate.holds(facts, requests):
            return f"when {self.when}"
        return None
