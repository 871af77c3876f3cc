"""`python step_kind_holds.py KIND BUNDLE`: exit 0 when BUNDLE's step is of KIND
(`e2e_support.STEP_KINDS`) — a `tracekit shrink --until command:` property that needs no engine."""

import sys

from e2e_support import STEP_KINDS, read_step

if __name__ == "__main__":
    kind, bundle = sys.argv[1], sys.argv[2]
    sys.exit(0 if STEP_KINDS[kind](read_step(bundle)) else 1)
