"""The release tests read bundles and run engines as the end-to-end tests do (tests/e2e's
helpers) and make each release's venv with tools/release_venv.py: both folders on sys.path."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for folder in (TESTS / "e2e", TESTS.parent / "tools"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
