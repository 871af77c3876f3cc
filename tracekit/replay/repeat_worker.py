"""The fresh process that replays a diverged step again (`repeats.repeat_in_fresh_process`).

    python -m tracekit.replay.repeat_worker BUNDLE OPTIONS OUT

Replays BUNDLE once with the `ReplayOptions` fields OPTIONS (JSON) and, where it does not
reproduce, `repeats` more times here (never in a further process), and writes its replays'
digests to OUT (a bundle it cannot replay: the one-line reason). Kept apart from `repeats`, which
the replay itself imports: this one imports the replay.
"""

import json
import sys
from pathlib import Path

from tracekit.errors import TracekitError
from tracekit.replay.repeats import HERE, Run
from tracekit.replay.replayer import ReplayOptions, replay


def main(argv: list[str]) -> int:
    bundle, options, out = argv
    try:
        result = replay(bundle, ReplayOptions(**json.loads(options), repeat_fresh=False))
    except TracekitError as error:
        Path(out).write_text(json.dumps({"error": str(error)}))
        return 0
    runs = result.repeats.runs if result.repeats is not None else [Run.of(HERE, result.checks)]
    Path(out).write_text(json.dumps({"runs": [run.to_plain() for run in runs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
