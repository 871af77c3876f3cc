"""Prompts files: JSON lines with sampling params or plain text lines; mistakes name the line."""

import pytest

from tracekit.errors import UsageError
from tracekit.record.workload import load_prompts


def test_json_lines_with_text_token_ids_and_sampling_params(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "Hello", "temperature": 0.7, "seed": 3}\n'
        "\n"
        '{"prompt_token_ids": [1, 5, 9], "max_tokens": 4}\n'
    )
    first, second = load_prompts(path)
    assert (first.prompt, first.sampling) == ("Hello", {"temperature": 0.7, "seed": 3})
    assert (second.prompt, second.sampling) == ([1, 5, 9], {"max_tokens": 4})


def test_json_lines_may_carry_a_grammar_and_a_lora_adapter(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "Pick", "structured_outputs": {"choice": ["yes", "no"]}, "lora": {"name": "a", "path": "/a"}}\n'
        '{"prompt": "Plain"}\n'
    )
    first, second = load_prompts(path)
    assert first.sampling == {"structured_outputs": {"choice": ["yes", "no"]}}
    assert (first.lora, second.lora) == ({"name": "a", "path": "/a"}, None)


def test_plain_text_is_one_prompt_per_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("first prompt\nsecond prompt\n")
    assert [request.prompt for request in load_prompts(path)] == ["first prompt", "second prompt"]


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"prompt": "ok"}\n{"prompt": \n', r":2: not JSON"),
        ('{"prompt": "ok"}\n[1, 2]\n', r":2: each line must be a JSON object"),
        ('{"prompt_token_ids": ["a"]}\n', r":1: needs \"prompt\""),
        ("\n\n", "holds no prompts"),
        ('{"prompt": "ok", "lora": "a"}\n', r':1: "lora" needs a "name" and a "path"'),
    ],
)
def test_bad_prompts_files_name_the_line(tmp_path, text, problem):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(UsageError, match=problem):
        load_prompts(path)


def test_a_missing_prompts_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot read prompts file"):
        load_prompts(tmp_path / "absent.jsonl")


def test_the_embedded_model_runs_its_small_engine_and_a_named_model_vllms_defaults():
    """A Llama-3-8B-shaped model with `--max-model-len 4096` under the tiny model's 64 MiB KV
    cache is refused by vLLM: a model the user names gets none of the embedded model's sizing."""
    from tracekit.models import tiny_model_path
    from tracekit.record.session import recording_engine_args
    from tracekit.record.workload import EMBEDDED_MODEL_ENGINE_ARGS

    assert recording_engine_args(None) == {**EMBEDDED_MODEL_ENGINE_ARGS, "model": tiny_model_path()}
    assert recording_engine_args("/models/llama-3-8b") == {"model": "/models/llama-3-8b"}
    assert recording_engine_args(None, engine_args={"max_num_seqs": 2})["max_num_seqs"] == 2
