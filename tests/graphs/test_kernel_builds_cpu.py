"""Which ptxas builds an engine's own Triton kernels (`tracekit.graphs.kernel_builds`), without
a GPU: Triton compiles a kernel for an H100 (sm_90) on any machine, with the ptxas binaries it
ships, so a real kernel is built here as the recording process built it and as a replay would
build it, and the PTX ISA and binary compared. The kernels' launches are a GPU's (tests/gpu)."""

import pytest

from tracekit.format.schema import KernelBuild
from tracekit.graphs import kernel_builds
from tracekit.graphs.kernel_builds import BuildsApplied, builds_applied, compare, isa_of_release, valid_builds

triton = pytest.importorskip("triton", reason="Triton is not installed with this vLLM")
tl = pytest.importorskip("triton.language")


@triton.jit
def _scaled_sum(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x * 0.5 + y * y, mask=mask)


SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}


def _source():
    from triton.compiler import ASTSource

    return ASTSource(_scaled_sum, SIGNATURE, {"BLOCK": 128})


def _build_for_h100(tmp_path, subdir):
    """Build the kernel for sm_90 as Triton's JIT would (through `triton.compiler.compile`), in a
    Triton cache of this test's own."""
    from triton.backends.compiler import GPUTarget

    with kernel_builds._variables({"TRITON_CACHE_DIR": str(tmp_path / subdir)}):
        return triton.compiler.compile(_source(), target=GPUTarget("cuda", 90, 32))


def _isa(kernel):
    return kernel_builds.ptx_isa_of(kernel.asm)


@pytest.fixture
def two_releases(tmp_path):
    """The ISA Triton builds for by itself here, and another one a ptxas of this machine gives."""
    try:
        default = _build_for_h100(tmp_path, "default")
    except Exception as error:  # a Triton without its NVIDIA backend's tools
        pytest.skip(f"Triton cannot build for sm_90 here: {type(error).__name__}: {error}")
    others = {isa: path for isa, path in kernel_builds.ptxas_by_isa().items() if isa != _isa(default)}
    if not others:
        pytest.skip(f"one ptxas release here ({_isa(default)}): nothing to choose between")
    return default, sorted(others.items())[0]


def test_the_isa_rule_is_tritons(two_releases):
    from triton.backends.nvidia.compiler import ptx_get_version

    for release in ("11.8", "12.4", "12.8", "12.9", "13.0", "13.4"):
        number = ptx_get_version(release)
        assert isa_of_release(release) == f"{number // 10}.{number % 10}", release


def test_a_recorded_kernel_is_built_by_a_ptxas_of_its_recorded_release(two_releases, tmp_path):
    default, (isa, _) = two_releases
    recorded = KernelBuild(kernel_builds.full_name(_scaled_sum), _source().hash(), isa, "0" * 64)
    with builds_applied([recorded]) as applied:
        assert not applied.missing
        built = _build_for_h100(tmp_path, "replay")
    assert _isa(built) == isa != _isa(default)
    assert built.kernel != default.kernel  # another binary, as the recording process ran
    # ... and read back as the recording process reads its kernels
    build = kernel_builds._build_of(_scaled_sum, built)
    assert (build.kernel, build.specialization, build.ptx_isa) == (recorded.kernel, recorded.specialization, isa)
    # outside the context Triton builds it as it would
    assert _isa(_build_for_h100(tmp_path, "after")) == _isa(default)


def test_the_replay_names_a_kernel_that_ran_another_binary(two_releases, tmp_path):
    default, (isa, _) = two_releases
    here = kernel_builds._build_of(_scaled_sum, default)
    as_recorded = KernelBuild(here.kernel, here.specialization, isa, "1" * 64)
    outcome = compare([as_recorded], [here])
    assert outcome["other"] == [f"{here.kernel}: a PTX ISA {_isa(default)} binary here, {isa} recorded"]
    same_release = KernelBuild(here.kernel, here.specialization, here.ptx_isa, "1" * 64)
    assert compare([same_release], [here])["other"] == [
        f"{here.kernel}: a PTX ISA {here.ptx_isa} binary here, another one for {here.ptx_isa} recorded "
        "(the same ptxas release built it otherwise)"]
    assert compare([here], [here])["same"] == [here.kernel]
    assert compare([], [here])["unrecorded"] == [here.kernel]


def test_a_release_no_ptxas_here_has_is_named_and_left_to_triton():
    build = KernelBuild("vllm.kernels.k", "a" * 64, "7.0", "b" * 64)
    applied = BuildsApplied([build], {"8.8": "/nowhere/ptxas"})
    assert applied.missing == {"vllm.kernels.k": "7.0"} and not applied.ptxas_of


@pytest.mark.parametrize("build", [
    KernelBuild("", "a" * 64, "8.8", "b" * 64),
    KernelBuild("k" * 301, "a" * 64, "8.8", "b" * 64),
    KernelBuild("k", "A" * 64, "8.8", "b" * 64),
    KernelBuild("k", "a" * 64, "8.8; rm -rf /", "b" * 64),
    KernelBuild("k", "a" * 64, "/usr/bin/ptxas", "b" * 64),
    KernelBuild("k", "a" * 64, "8.8", "short"),
    KernelBuild("k", "a" * 64, 8.8, "b" * 64),  # type: ignore[arg-type]
])
def test_a_build_no_kernel_can_have_is_left_out(build):
    """A bundle is untrusted: only a name, two digests and an ISA number come from it."""
    assert valid_builds([build]) == []
    assert BuildsApplied([build], {"8.8": "/nowhere/ptxas"}).ptxas_of == {}
