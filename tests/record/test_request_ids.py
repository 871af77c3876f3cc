"""Client-visible request ids match exactly the engine requests vLLM derives from them."""

import uuid

import pytest

from tracekit.integrations.vllm.records.request_ids import client_id_matcher


def _engine_id(response_id: str, index: str = "", child: str = "", randomized: bool = True) -> str:
    """vLLM's own derivation (the serving layer's index, `assign_request_id`'s suffix, parallel sampling's prefix)."""
    internal = f"{response_id}{index}"
    if randomized:
        internal = f"{internal}-{uuid.uuid4().hex:.8}"
    return f"{child}{internal}"


@pytest.mark.parametrize("randomized", [True, False])
def test_a_response_id_matches_its_requests_and_no_other(randomized):
    def ours(client_id):
        return client_id_matcher(client_id, randomized)

    completion = _engine_id("cmpl-99a6ae51716401f0", "-0", randomized=randomized)
    second_prompt = _engine_id("cmpl-99a6ae51716401f0", "-1", randomized=randomized)
    child = _engine_id("cmpl-99a6ae51716401f0", "-0", child="2_", randomized=randomized)
    chat = _engine_id("chatcmpl-99a6ae51716401f0", randomized=randomized)
    assert ours("cmpl-99a6ae51716401f0")(completion)
    assert ours("cmpl-99a6ae51716401f0")(second_prompt) and ours("cmpl-99a6ae51716401f0")(child)
    assert ours("chatcmpl-99a6ae51716401f0")(chat)
    assert not ours("cmpl-99a6ae51716401f0")(chat) and not ours("chatcmpl-99a6ae51716401f0")(completion)
    # a longer id that starts with the same characters is another request, whatever its tail
    longer = _engine_id("cmpl-99a6ae51716401f0-0", "-0", randomized=randomized)
    assert ours("cmpl-99a6ae51716401f0-0")(longer)
    assert not ours("cmpl-99a6ae51716401f0")(longer)
    assert not ours("cmpl-99a6")(completion)


def test_a_header_value_matches_the_requests_of_either_endpoint():
    matches = client_id_matcher("incident-42", randomized=True)
    assert matches(_engine_id("cmpl-incident-42", "-0"))
    assert matches(_engine_id("chatcmpl-incident-42"))
    assert matches(_engine_id("chatcmpl-incident-42", "_1"))
    assert not matches(_engine_id("cmpl-incident-42-0", "-0"))  # the header incident-42-0
    assert not matches("incident-42")  # not an id vLLM's server makes


def test_an_id_with_regex_characters_is_taken_literally():
    matches = client_id_matcher("a.b+c", randomized=True)
    assert matches(_engine_id("cmpl-a.b+c", "-0"))
    assert not matches(_engine_id("cmpl-aXbbc", "-0"))
