"""The docs stay a front door and a reference that agree with the code: the README short, its
first two commands what a new user and CI run, every link between the docs resolving, every
setting the vLLM plugin reads documented."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted([README, *ROOT.glob("docs/**/*.md")])
README_MAX_LINES = 250  # issue 48: a front door of ~200 lines; the reference is docs/GUIDE.md


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move reference material to docs/GUIDE.md, "
        "dated results to docs/history/")


def _first_two_commands() -> list[str]:
    section = README.read_text().split("## First two commands", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readmes_second_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in ci if line.strip() and not line.startswith(("#", "set ", "cd "))]
    first, second = _first_two_commands()
    assert " && ".join(commands) == second, ".ci/run and the README's second command differ"


def test_the_readmes_first_command_sets_up_then_records_and_replays_on_the_embedded_model():
    """On a fresh machine: the same set-up as CI's, then a recording with no --model (the embedded
    tiny model) and the replay of that very bundle."""
    first, second = _first_two_commands()
    setup, record, replay = first.split(" && ")
    assert setup == second.split(" && ")[0]
    output = re.fullmatch(r"\.venv/bin/tracekit record -o (\S+)", record)
    assert output, record
    assert replay == f".venv/bin/tracekit replay {output.group(1)}"


def _without_code(text: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: Path) -> set[str]:
    """The ids GitHub gives a file's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated one numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", path.read_text(),
                                                         flags=re.MULTILINE | re.DOTALL), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_link_between_the_docs_resolves():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            if not resolved.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and (resolved.is_dir() or anchor not in _anchors(resolved)):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_recording_setting_is_in_the_guide():
    """Every `TRACEKIT_RECORD_*` variable tracekit reads (the plugin's settings) is documented."""
    settings = {name for module in (ROOT / "tracekit").rglob("*.py")
                for name in re.findall(r"\bTRACEKIT_RECORD_[A-Z_]+\b", module.read_text())}
    assert "TRACEKIT_RECORD_OUTPUT" in settings
    guide = (ROOT / "docs" / "GUIDE.md").read_text()
    missing = sorted(name for name in settings if f"`{name}`" not in guide)
    assert not missing, f"docs/GUIDE.md does not document {missing}"


SERVING_SECTION_MAX_LINES = 15  # issue 50: the serving engineer's first section, every command run by a test


def test_the_readmes_serving_section_is_short_and_its_commands_are_the_ones_a_test_runs():
    """`tests/e2e/test_serve_live.py` runs the section's commands in order (install, serve, arm,
    status, disarm, replay); here, that they are those, in a section of at most 15 lines."""
    section = README.read_text().split("## In a running vllm serve\n", 1)[1].split("\n## ", 1)[0].strip("\n")
    assert len(section.splitlines()) <= SERVING_SECTION_MAX_LINES, section
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split()[0] if not line.startswith("VLLM_") else "serve" for line in block.splitlines()
                if line.strip() and not line.startswith("#")]
    assert commands == ["pip", "serve", "tracekit", "tracekit", "tracekit", "tracekit"], block
