"""Issue 51, every argument honoured or refused: an option no one knows is refused before vLLM is
imported, with the closest match; the flags mean the same in every command; `--on` takes commas;
`diff --json` is strict JSON. And issue 48 item 6: the commands stay thin."""

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracekit.cli import SUBCOMMANDS

PACKAGE = Path(__file__).resolve().parents[2] / "tracekit"
TRACES = PACKAGE.parent / "traces"
SAMPLE = TRACES / "tiny-llama-mixed-step.zst"
TRACEKIT = str(Path(sys.executable).with_name("tracekit"))
# The longest a function under tracekit/cli/ may be, in lines (issue 48: each command parses,
# calls one function of the layer below, and prints).
LONGEST_CLI_FUNCTION = 60


def _run(*arguments, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([TRACEKIT, *map(str, arguments)], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _with_imports_reported(*modules: str) -> str:
    """Python code that runs the tracekit command and, as it exits, writes to stderr which of
    `modules` it imported (`imported: ` and their names)."""
    return ("import atexit, sys\n"
            f"atexit.register(lambda: sys.stderr.write('imported: ' + ' '.join(m for m in {modules!r} "
            "if m in sys.modules) + '\\n'))\n"
            "from tracekit.cli import main\nmain()\n")


@pytest.mark.parametrize(("command", "typo", "meant"), [
    ("record", "--stpes", "--steps"), ("replay", "--no-timeing", "--no-timing"), ("record", "--step", "--steps"),
])
def test_an_unknown_option_is_refused_before_vllm_or_torch_is_imported_with_the_closest_match(command, typo, meant):
    """`record --stpes 3` used to start vLLM (14 s) and fail as an unknown engine argument."""
    arguments = [command, *([SAMPLE] if command == "replay" else []), typo, "3"]
    started = time.monotonic()
    finished = subprocess.run([sys.executable, "-c", _with_imports_reported("torch", "vllm"), *map(str, arguments)],
                              capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2, finished.stderr
    assert finished.stderr == (f"tracekit: error: unknown option {typo}: not a tracekit {command} option nor a vLLM "
                               f"engine argument; did you mean {meant}?\nimported: \n")
    assert time.monotonic() - started < 5  # the bar: a typo costs no engine start


def test_engine_arguments_pass_the_check_in_vllms_own_spellings():
    from tracekit.integrations.vllm.engines.engine_options import engine_option_names, is_engine_option

    names = engine_option_names()
    if names is None:
        pytest.skip("no vLLM here whose options can be read")
    for token in ("--max-model-len", "--max_model_len=512", "--enforce-eager", "--no-enable-prefix-caching",
                  "-tp", "--compilation-config.mode", "-O3", "--max-num-batched"):
        assert is_engine_option(token, names), token
    for token in ("--stpes", "--no-timeing", "--no-max-model-len"):
        assert not is_engine_option(token, names), token


def test_every_option_vllms_parser_takes_is_read_from_its_source():
    """The source reader is a superset of the real parser: no engine argument is ever refused."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from tracekit.integrations.vllm.engines.engine_options import engine_option_names

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="tracekit", add_help=False))
    assert set(parser._option_string_actions) <= engine_option_names()


def test_renamed_flags_are_refused_naming_the_new_spelling():
    assert "--step is now --steps" in _run("replay", SAMPLE, "--step", "1").stderr
    refused = _run("replay", SAMPLE, "--layers", "out.zst")
    assert refused.returncode == 2 and "--save-layers FILE" in refused.stderr
    assert "this command takes one step" in _run("replay", SAMPLE, "--steps", "1:3").stderr


def test_on_takes_commas_and_refuses_an_unknown_event_before_any_engine():
    finished = _run("record", "--on", "exception,nonfinit")
    assert finished.returncode == 2 and "unknown trigger 'nonfinit'" in finished.stderr, finished.stderr


def test_help_and_every_command_module_load_neither_torch_nor_vllm():
    """`tracekit --help` imports every command's module: none may import torch or vLLM at load."""
    for arguments in (["--help"], *([name, "--help"] for name in SUBCOMMANDS)):
        finished = subprocess.run([sys.executable, "-c", _with_imports_reported("torch", "vllm"), *arguments],
                                  capture_output=True, text=True, timeout=60)
        assert finished.returncode == 0 and finished.stderr == "imported: \n", (arguments, finished.stderr)


def test_json_after_or_before_the_bundle(tmp_path):
    """`--json` alone (or `-`) is standard output; given before the bundle it would take the bundle
    for its file: that is refused, naming what happened."""
    alone = _run("inspect", SAMPLE, "--json")
    assert alone.returncode == 0 and json.loads(alone.stdout)["needs"]["vllm_series"] == "0.32"
    assert json.loads(_run("inspect", SAMPLE, "--json", "-").stdout)["needs"]["runner"] == "v1"
    before = _run("inspect", "--json", SAMPLE)
    assert before.returncode == 2 and f"--json took {SAMPLE} as the file to write" in before.stderr


def test_diff_json_is_strict_json_with_a_reason_for_what_is_not_a_number(tmp_path):
    from tracekit.format.rewrite import rewrite_bundle

    def not_a_number(metadata, tensors):
        tensors["steps/0/outputs/hidden_states"][0, 0] = float("nan")

    other = rewrite_bundle(SAMPLE, tmp_path / "nan.zst", not_a_number)
    finished = _run("diff", SAMPLE, other, "--json")
    assert finished.returncode == 1, finished.stderr
    compared = json.loads(finished.stdout, parse_constant=lambda name: pytest.fail(f"not JSON: {name}"))
    hidden = next(tensor for tensor in compared["tensors"] if tensor["name"] == "steps/0/outputs/hidden_states")
    assert (hidden["max_abs"], hidden["max_abs_not_finite"]) == (None, "inf")
    assert (hidden["relative_rms"], hidden["relative_rms_not_finite"]) == (None, "nan")
    assert compared["first_difference"]["relative_rms_not_finite"] == "nan"


def test_the_largest_function_in_the_cli_is_short():
    longest = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                longest.append((node.end_lineno - node.lineno + 1, f"{path.name}:{node.lineno} {node.name}"))
    lines, where = max(longest)
    assert lines <= LONGEST_CLI_FUNCTION, f"{where} is {lines} lines long"
