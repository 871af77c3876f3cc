"""Issue 51: the README (and docs/GUIDE.md) agree with the tool.

Every `tracekit` command the documents show in a bash block is checked against the command's
own options (and, for those that take them, vLLM's engine arguments); every one that starts no
engine (inspect, diff, export, redact) is run, in a folder where the bundles it names exist, and
must end with the exit code its comment states (`# exit N`; 0 where none is stated); and
`tracekit replay traces/` must exit as the prose says it does.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from tracekit.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [path for path in (ROOT / "README.md", ROOT / "docs" / "GUIDE.md") if path.exists()]
SAMPLE = ROOT / "traces" / "tiny-llama-mixed-step.zst"
TRACEKIT = str(Path(sys.executable).with_name("tracekit"))
# The commands that start no engine: cheap enough to run here, whatever they are given.
CHEAP = {"inspect", "diff", "export", "redact"}
# An exit code a command's comment states (`# exit 2`), not a list of them (`# exit 0 ok, 1 ...`).
STATED_EXIT = re.compile(r"#\s*exits?\s+(\d)\b(?![^#]*\d\s+\w[^,]*,)")


def documented_commands() -> list[tuple[str, int, str]]:
    """(document, line number, command line) of every `tracekit ...` line in a bash block."""
    found = []
    for document in DOCUMENTS:
        inside = False
        for number, line in enumerate(document.read_text().splitlines(), 1):
            if line.strip().startswith("```"):
                inside = line.strip() == "```bash"
                continue
            if inside and line.strip().startswith("tracekit "):
                found.append((document.name, number, line.strip()))
    return found


COMMANDS = documented_commands()


def _words(line: str) -> tuple[list[str], str]:
    """The command's words and its comment."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=False)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    comment = re.search(r"\s(#\s.*)$", line)
    return list(lexer), comment.group(1) if comment else ""


def _command_options(name: str) -> set[str]:
    command = main.get_command(click.Context(main), name)
    return {option for parameter in command.params for option in (*parameter.opts, *parameter.secondary_opts)}


@pytest.mark.parametrize(("document", "number", "line"), COMMANDS, ids=[f"{d}:{n}" for d, n, _ in COMMANDS])
def test_every_documented_option_is_one_the_command_takes(document, number, line):
    from tracekit.integrations.vllm.engines.engine_options import engine_option_names, is_engine_option

    words, _ = _words(line)
    name = words[1]
    if name.startswith("-"):
        assert name in ("--help", "-h", "--version"), line
        return
    assert name in main.list_commands(click.Context(main)), f"{document}:{number}: no command {name}"
    own = _command_options(name)
    engine = engine_option_names() if name in ("record", "replay") else None
    for word in words[2:]:
        if not word.startswith("-") or word == "-" or word.split("=")[0] in own:
            continue
        assert engine is not None and is_engine_option(word, engine), (
            f"{document}:{number}: tracekit {name} takes no option {word}: {line}")


def _placeholders(words: list[str], folder: Path) -> None:
    """Bundles a documented command names that are not in the repository: copies of the sample,
    in the folder it runs in (outputs, after -o, are left to the command)."""
    for before, word in zip(["", *words], words):
        if word.endswith(".zst") and before not in ("-o", "--output") and not (ROOT / word).exists():
            (folder / word).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(SAMPLE, folder / word)


CHEAP_COMMANDS = [command for command in COMMANDS if _words(command[2])[0][1] in CHEAP]


@pytest.mark.parametrize(("document", "number", "line"), CHEAP_COMMANDS,
                         ids=[f"{d}:{n}" for d, n, _ in CHEAP_COMMANDS])
def test_every_cheap_documented_command_ends_as_stated(tmp_path, document, number, line):
    words, comment = _words(line)
    stated = STATED_EXIT.search(comment)
    expected = int(stated.group(1)) if stated else 0
    (tmp_path / "traces").symlink_to(ROOT / "traces")
    _placeholders(words, tmp_path)
    finished = subprocess.run([TRACEKIT, *words[1:]], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert finished.returncode == expected, f"{document}:{number}: {line}\n{finished.stderr}"


def test_tracekit_replay_traces_exits_as_the_documents_say():
    stated = set()
    for document in DOCUMENTS:
        text = " ".join(document.read_text().split())
        stated |= {int(code) for code in re.findall(r"`tracekit replay traces/`[^.]*? exits (\d)", text)}
    assert len(stated) == 1, f"the documents should say, once, what `tracekit replay traces/` exits with: {stated}"
    finished = subprocess.run([TRACEKIT, "replay", "traces/"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert finished.returncode == stated.pop(), finished.stdout + finished.stderr
