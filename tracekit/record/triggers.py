"""When the recorder fires: by step index, by a predicate on the batch, on exception, on
non-finite outputs.

Step and predicate triggers are decided before the forward from cheap batch facts, so an armed
recorder that does not fire costs one comparison per step. Exception and non-finite triggers
cannot know in advance: each step leaves a cheap mark and a device-side finite check, and only a
step that fails (or is not finite) is copied, then (`recorder.py` says how).

Predicates are a tiny language, parsed here and never evaluated as Python:

    clause ("and" clause)*      clause = NAME | NAME OP VALUE      OP = == != >= <= > <
    names: num_reqs, num_tokens, num_prefills, num_decodes (ints), has_prefill, has_decode,
           mixed (booleans), req_id (true when any request of the batch has that id)
"""

import operator
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from tracekit.errors import UsageError
from tracekit.integrations.seam import BatchFacts

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


class TriggerEvent(str, Enum):
    """Triggers decided after the forward, by what happened in the step."""

    EXCEPTION = "exception"  # the step raised (in any phase)
    NONFINITE = "nonfinite"  # its hidden states or logits hold NaN or inf


EVENT_TRIGGERS = tuple(event.value for event in TriggerEvent)

# The most bundles one recording writes where its output takes every firing step (`{step}`).
DEFAULT_MAX_BUNDLES = 16


def parse_steps(text: str) -> Callable[[int], bool]:
    """`7`, `5:9` (5 to 8, as a Python slice), `3,7,10:12`, `5:` (5 onwards)."""
    tests: list[Callable[[int], bool]] = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)?(:)?(\d+)?", part)
        if not part or not match or (match.group(2) is None and match.group(3) is not None):
            raise UsageError(f"bad --steps {text!r}: use an index (7), a range (5:9) or a list (3,7)")
        start, is_range, stop = match.groups()
        if not is_range:
            tests.append(lambda index, at=int(start): index == at)
            continue
        low, high = int(start or 0), int(stop) if stop is not None else None
        if high is not None and high <= low:
            raise UsageError(f"bad --steps {text!r}: empty range {part}")
        tests.append(lambda index, low=low, high=high: index >= low and (high is None or index < high))
    return lambda index: any(test(index) for test in tests)


def parse_predicate(text: str) -> Callable[[BatchFacts], bool]:
    clauses = [_parse_clause(clause, text) for clause in re.split(r"\s+and\s+", text.strip())]
    return lambda facts: all(clause(facts) for clause in clauses)


def _parse_clause(clause: str, whole: str) -> Callable[[BatchFacts], bool]:
    match = _CLAUSE.match(clause)
    if not match:
        raise UsageError(f"bad --when {whole!r}: cannot read {clause!r} (use e.g. 'num_reqs>=2 and has_prefill')")
    name, op, value = match.groups()
    known = _INT_FACTS + _BOOL_FACTS + ("req_id",)
    if name not in known:
        raise UsageError(f"bad --when {whole!r}: unknown name {name!r} (known: {', '.join(known)})")
    if name in _BOOL_FACTS:
        if op is not None:
            raise UsageError(f"bad --when {whole!r}: {name} is a flag, use it alone")
        return lambda facts: getattr(facts, name)
    if op is None:
        raise UsageError(f"bad --when {whole!r}: {name} needs a comparison, e.g. {name}>=2")
    if name == "req_id":
        if op not in ("==", "!="):
            raise UsageError(f"bad --when {whole!r}: req_id takes == or !=")
        wanted = value.strip("'\"")
        return lambda facts: (wanted in facts.req_ids) == (op == "==")
    if not re.fullmatch(r"-?\d+", value):
        raise UsageError(f"bad --when {whole!r}: {name} compares with a whole number, not {value!r}")
    compare, number = _OPERATORS[op], int(value)
    return lambda facts: compare(getattr(facts, name), number)


@dataclass
class TriggerSet:
    """All armed triggers; `fires_before_forward` names what fired for the bundle's `trigger`
    field (events name themselves)."""

    steps: str | None = None
    when: str | None = None
    events: tuple[str, ...] = ()
    _step_test: Callable[[int], bool] | None = field(default=None, repr=False)
    _predicate: Callable[[BatchFacts], bool] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        unknown = [event for event in self.events if event not in EVENT_TRIGGERS]
        if unknown:
            raise UsageError(f"unknown trigger {unknown[0]!r} (known: {', '.join(EVENT_TRIGGERS)})")
        self.events = tuple(TriggerEvent(event) for event in self.events)
        if self.steps is not None:
            self._step_test = parse_steps(self.steps)
        if self.when is not None:
            self._predicate = parse_predicate(self.when)
        if self.steps is None and self.when is None and not self.events:
            raise UsageError("nothing to record: give --steps, --when or --on exception/nonfinite")

    def fires_before_forward(self, index: int, facts: Callable[[], BatchFacts]) -> str | None:
        """The reason this step is recorded, decided before its forward; None if it is not.
        `facts` is only called when a predicate needs them."""
        if self._step_test is not None:
            if not self._step_test(index):
                return None
            if self._predicate is None:
                return f"steps {self.steps}"
            return f"steps {self.steps} when {self.when}" if self._predicate(facts()) else None
        if self._predicate is not None and self._predicate(facts()):
            return f"when {self.when}"
        return None
