"""The trigger language: what fires, and that a mistyped trigger is refused with its reason."""

import pytest

from tracekit.errors import UsageError
from tracekit.integrations.seam import BatchFacts, RequestProgress
from tracekit.record.triggers import RequestWatch, SettingNames, TriggerSet, parse_predicate, parse_steps

DECODES = BatchFacts(num_reqs=3, num_tokens=3, num_prefills=0, req_ids=frozenset({"a", "b", "c"}))
MIXED = BatchFacts(num_reqs=4, num_tokens=67, num_prefills=1, req_ids=frozenset({"a", "b", "c", "long"}))


@pytest.mark.parametrize(
    "text, fired",
    [
        ("7", {7}),
        ("5:9", {5, 6, 7, 8}),
        ("3,7,10:12", {3, 7, 10, 11}),
        ("18:", {18, 19}),
    ],
)
def test_steps_select_exactly_their_indices(text, fired):
    test = parse_steps(text)
    assert {index for index in range(20) if test(index)} == fired


@pytest.mark.parametrize("text", ["", "a", "9:3", "3:3", "1;2", ":5x", "-1"])
def test_bad_steps_are_refused(text):
    with pytest.raises(UsageError, match="--steps"):
        parse_steps(text)


@pytest.mark.parametrize(
    "text, on_decodes, on_mixed",
    [
        ("mixed", False, True),
        ("has_prefill", False, True),
        ("has_decode", True, True),
        ("num_reqs>=4", False, True),
        ("num_tokens < 10", True, False),
        ("num_decodes==3 and has_prefill", False, True),
        ("req_id==long", False, True),
        ("req_id!=long", True, False),
        ("num_prefills!=0", False, True),
    ],
)
def test_predicates(text, on_decodes, on_mixed):
    predicate = parse_predicate(text)
    assert (predicate.holds(lambda: DECODES, tuple), predicate.holds(lambda: MIXED, tuple)) == (on_decodes, on_mixed)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("num_reqs>>2", "cannot read"),
        ("foo==1", "unknown name 'foo'"),
        ("mixed==1", "is a flag"),
        ("num_reqs", "needs a comparison"),
        ("num_reqs>=two", "whole number"),
        ("req_id>=a", "takes == or !="),
        ("__import__('os')", "cannot read"),
    ],
)
def test_bad_predicates_name_the_problem(text, reason):
    with pytest.raises(UsageError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        parse_predicate(text)


def test_steps_and_predicate_must_both_hold():
    triggers = TriggerSet(steps="0:10", when="mixed")
    assert triggers.fires_before_forward(2, lambda: DECODES) is None
    assert triggers.fires_before_forward(2, lambda: MIXED) == "steps 0:10 when mixed"
    assert triggers.fires_before_forward(12, lambda: MIXED) is None


def test_a_step_trigger_alone_never_asks_for_batch_facts():
    def no_facts():
        raise AssertionError("batch facts computed for an index-only trigger")

    triggers = TriggerSet(steps="3")
    assert triggers.fires_before_forward(2, no_facts) is None
    assert triggers.fires_before_forward(3, no_facts) == "steps 3"


def test_event_triggers_fire_only_after_the_forward():
    triggers = TriggerSet(events=("exception", "nonfinite"))
    assert triggers.events and triggers.fires_before_forward(0, lambda: MIXED) is None


def test_nothing_to_record_and_unknown_events_are_refused():
    with pytest.raises(UsageError, match="nothing to record"):
        TriggerSet()
    with pytest.raises(UsageError, match="unknown trigger 'crash'"):
        TriggerSet(events=("crash",))


def _named(*progress):
    return lambda: list(progress)


@pytest.mark.parametrize(
    "text, first, decode_5, decode_9",
    [
        ("request==cmpl-1", True, True, True),
        ("request==cmpl-1 and first_chunk", True, False, False),
        ("request==cmpl-1 and generated==5", False, True, False),
        ("request==cmpl-1 and generated<8", True, True, False),
        ("request==cmpl-1 and generated>=5 and num_reqs>=4", False, True, True),
    ],
)
def test_request_triggers_read_the_named_requests_progress(text, first, decode_5, decode_9):
    triggers = TriggerSet(when=text)
    assert triggers.request == "cmpl-1"
    fired = [triggers.fires_before_forward(0, lambda: MIXED, _named(progress)) is not None for progress in
             (RequestProgress(True, 0), RequestProgress(False, 5), RequestProgress(False, 9))]
    assert fired == [first, decode_5, decode_9]


def test_a_step_without_the_named_request_never_asks_for_batch_facts():
    def no_facts():
        raise AssertionError("batch facts computed for a step the request is not in")

    triggers = TriggerSet(when="request==cmpl-1 and num_reqs>=2")
    assert triggers.fires_before_forward(0, no_facts, _named()) is None


@pytest.mark.parametrize(
    "text, reason",
    [
        ("generated<3", "about the request named by request==ID"),
        ("request!=cmpl-1", "request takes =="),
        ("request==a and request==b", "one request"),
        ("request==a and first_chunk==1", "is a flag"),
    ],
)
def test_bad_request_triggers_name_the_problem(text, reason):
    with pytest.raises(UsageError, match=reason):
        parse_predicate(text)


def test_a_refusal_names_the_setting_as_the_user_spelled_it():
    names = SettingNames(steps="TRACEKIT_RECORD_STEPS", when="TRACEKIT_RECORD_WHEN", on="TRACEKIT_RECORD_ON")
    with pytest.raises(UsageError, match="bad TRACEKIT_RECORD_WHEN 'foo==1'"):
        TriggerSet(when="foo==1", names=names)
    with pytest.raises(UsageError, match="give TRACEKIT_RECORD_STEPS, TRACEKIT_RECORD_WHEN or TRACEKIT_RECORD_ON"):
        TriggerSet(names=names)


def test_the_request_watch_matches_each_engine_id_once():
    asked = []
    watch = RequestWatch(lambda req_id: asked.append(req_id) or req_id.startswith("cmpl-1-"))
    assert watch.named(["cmpl-1-0-aa", "cmpl-2-0-bb"]) == ["cmpl-1-0-aa"]
    assert watch.named(["cmpl-2-0-bb", "cmpl-1-0-aa", "cmpl-3-0-cc"]) == ["cmpl-1-0-aa"]
    assert asked == ["cmpl-1-0-aa", "cmpl-2-0-bb", "cmpl-3-0-cc"]
