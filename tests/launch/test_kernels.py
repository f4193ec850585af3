"""Kernel modules on every backend: the shipped PTX, launches eager and captured, preflight, faults."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from metrale_core import (
    ArchitectureError,
    BackendClosedError,
    GpuBackend,
    InvalidArgumentError,
    InvalidBufferError,
    KernelNotFoundError,
    KernelRegistry,
    MetraleError,
    kernel_implementation,
    open_backend,
    parse_ptx,
)
from metrale_core.kernels import shipped_modules
from metrale_core.testing import FaultInjecting
from tests._support import SETTINGS

# every test here that runs on each backend (those taking backend_name) needs the backend to run kernels
pytestmark = pytest.mark.needs("kernels")

N = 3000


@pytest.fixture
def modules(gpu: GpuBackend) -> Iterator[KernelRegistry]:
    with gpu.load_modules(shipped_modules()) as registry:
        yield registry


def _vectors(gpu: GpuBackend) -> tuple[np.ndarray, np.ndarray, list[object]]:
    rng = np.random.default_rng(7)
    a = rng.standard_normal(N).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    bufs = [gpu.alloc(4 * N) for _ in range(3)]
    gpu.copy_to_device(bufs[0], a)
    gpu.copy_to_device(bufs[1], b)
    return a, b, bufs


def _read(gpu: GpuBackend, buf: object) -> np.ndarray:
    out = np.empty(N, dtype=np.float32)
    gpu.copy_to_host(out, buf)  # type: ignore[arg-type]
    return out


def test_vector_add_eager(gpu: GpuBackend, modules: KernelRegistry) -> None:
    add = modules.kernel("vector", "vector_add")
    assert modules.kernel("vector", "vector_add") is add, "kernel handles are cached"
    a, b, (da, db, dout) = _vectors(gpu)
    gpu.launch(add, (N + 255) // 256, 256, [da, db, dout, np.uint32(N)])
    np.testing.assert_array_equal(_read(gpu, dout), a + b)


def test_vector_add_in_a_captured_graph(gpu: GpuBackend, modules: KernelRegistry) -> None:
    add = modules.kernel("vector", "vector_add")
    a, b, (da, db, dout) = _vectors(gpu)
    gpu.memset(dout, 0)
    gpu.synchronize()
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    gpu.launch(add, (N + 255) // 256, 256, [da, db, dout, np.uint32(N)], stream=stream)
    gpu.launch(add, (N + 255) // 256, 256, [dout, db, dout, np.uint32(N)], stream=stream)
    exe = gpu.end_capture(stream).instantiate()
    assert not _read(gpu, dout).any(), "a captured launch ran before the graph was launched"
    assert set(exe.buffers) == {da, db, dout}
    exe.launch(stream)
    stream.synchronize()
    np.testing.assert_allclose(_read(gpu, dout), a + b + b, rtol=1e-6)


def test_fill_one_past_the_end_lands_in_the_red_zone(backend_name: str) -> None:
    with open_backend(backend_name, settings=SETTINGS.updated(redzone=256, redzone_action="warn")) as gpu:
        registry = gpu.load_modules(shipped_modules("vector"))
        buf = gpu.alloc(4 * 100)
        gpu.launch(registry.kernel("vector", "fill_u32"), 1, 128, [buf, np.uint32(101), np.uint32(5)])
        found = gpu.scan_redzones()
        assert [(v.index, v.side, v.offset) for v in found] == [(buf.index, "trail", 0)]
        out = np.empty(100, dtype=np.uint32)
        gpu.copy_to_host(out, buf)
        assert (out == 5).all()


def test_lookup_of_missing_names_lists_what_is_held(modules: KernelRegistry) -> None:
    with pytest.raises(KernelNotFoundError, match=r"vector: vector_add, fill_u32; fault: write_to") as info:
        modules.kernel("vector", "vector_mul")
    assert info.value.name == "CUDA_ERROR_NOT_FOUND"
    with pytest.raises(KernelNotFoundError, match="no module 'nope'"):
        modules.kernel("nope", "vector_add")
    assert modules.modules == {
        "vector": ("vector_add", "fill_u32"), "fault": ("write_to", "write_u8"),
        "redzone": ("redzone_scan", "redzone_verdict"), "tma": ("tma_copy_2d",),
    }


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (lambda d: [d, d, d], "takes 4 argument"),
        (lambda d: [d, d, d, N], "is not a pointer"),
        (lambda d: [d, d, d, np.int64(N)], "does not take"),
        (lambda d: [d, d, d, np.float32(N)], "does not take"),
        (lambda d: [d, d, 1.5, np.uint32(N)], "explicitly typed scalar"),
        (lambda d: [d, d, "x", np.uint32(N)], "explicitly typed scalar"),
        (lambda d: "abcd", "list or tuple"),
    ],
)
def test_bad_arguments_are_refused_before_the_driver(
    gpu: GpuBackend, modules: KernelRegistry, args: object, match: str
) -> None:
    add = modules.kernel("vector", "vector_add")
    buf = gpu.alloc(4 * N)
    with pytest.raises(InvalidArgumentError, match=match):
        gpu.launch(add, 1, 32, args(buf))  # type: ignore[operator]
    assert gpu.run_metrics().launches.get(("vector", "vector_add"), 0) == 0


def test_typed_scalars_and_raw_pointers(gpu: GpuBackend, modules: KernelRegistry) -> None:
    fill = modules.kernel("vector", "fill_u32")
    buf = gpu.alloc(4 * 64)
    gpu.launch(fill, 1, 64, [buf.ptr, ctypes.c_uint32(64), np.uint32(9)])
    out = np.empty(64, dtype=np.uint32)
    gpu.copy_to_host(out, buf)
    assert (out == 9).all()


def test_launch_shapes_are_checked(gpu: GpuBackend, modules: KernelRegistry) -> None:
    fill = modules.kernel("vector", "fill_u32")
    buf = gpu.alloc(64)
    for grid, block in [(0, 1), (1, 2048), (1, (32, 32, 2)), ((1, 1, 1, 1), 1), (1, True), ("1", 1)]:
        with pytest.raises(InvalidArgumentError):
            gpu.launch(fill, grid, block, [buf, np.uint32(1), np.uint32(1)])  # type: ignore[arg-type]


def test_stale_buffer_is_refused(gpu: GpuBackend, modules: KernelRegistry) -> None:
    fill = modules.kernel("vector", "fill_u32")
    buf = gpu.alloc(64)
    gpu.free(buf)
    with pytest.raises(InvalidBufferError):
        gpu.launch(fill, 1, 16, [buf, np.uint32(16), np.uint32(1)])


def test_preflight_refuses_newer_architectures_together(gpu: GpuBackend) -> None:
    major, minor = gpu.compute_capability()
    newer = f"sm_{major + 1}0"
    vector = shipped_modules("vector")["vector"].replace(b".target sm_75", f".target {newer}".encode())
    fault = shipped_modules("fault")["fault"].replace(b".target sm_75", f".target {newer}a".encode())
    with pytest.raises(ArchitectureError) as info:
        gpu.load_modules({"fine": shipped_modules("vector")["vector"], "vector": vector, "fault": fault})
    text = str(info.value)
    assert f"capability {major}.{minor}" in text and f"vector (targets {newer}" in text
    assert f"fault (targets {newer}a" in text and "fine" not in text
    assert info.value.name == "CUDA_ERROR_NO_BINARY_FOR_GPU"
    with pytest.raises(ArchitectureError):
        gpu.preflight({"vector": vector})


def test_parse_ptx_targets() -> None:
    image = parse_ptx("vector", shipped_modules("vector")["vector"])
    assert (image.target, image.version) == ("sm_75", (9, 0))
    assert [p.describe() for p in image.entries["vector_add"]] == [".u64", ".u64", ".u64", ".u32"]
    assert image.runs_on((7, 5)) and image.runs_on((9, 0)) and not image.runs_on((7, 0))
    arch = parse_ptx("x", ".version 8.0\n.target sm_90a\n")
    assert arch.runs_on((9, 0)) and not arch.runs_on((10, 0))
    with pytest.raises(InvalidArgumentError, match="not a PTX image"):
        parse_ptx("junk", b"hello")


def test_registry_close_and_backend_close(backend_name: str) -> None:
    gpu = open_backend(backend_name, settings=SETTINGS)
    registry = gpu.load_modules(shipped_modules("vector"))
    fill = registry.kernel("vector", "fill_u32")
    buf = gpu.alloc(64)
    registry.close()
    registry.close()
    with pytest.raises(MetraleError, match="registry"):
        gpu.launch(fill, 1, 16, [buf, np.uint32(16), np.uint32(1)])
    with pytest.raises(MetraleError):
        registry.kernel("vector", "fill_u32")
    kept = gpu.load_modules(shipped_modules("vector"))
    gpu.close()  # unloads what is still loaded
    assert kept.closed


def test_run_metrics_audit_and_timing(backend_name: str) -> None:
    with open_backend(backend_name, settings=SETTINGS.updated(kernel_timing=True)) as gpu:
        registry = gpu.load_modules(shipped_modules("vector"))
        fill = registry.kernel("vector", "fill_u32")
        registry.kernel("vector", "vector_add")
        buf = gpu.alloc(4 << 20)
        for _ in range(3):
            gpu.launch(fill, 4096, 256, [buf, np.uint32(1 << 20), np.uint32(3)])
        metrics = gpu.run_metrics()
        assert metrics.lookups == [("vector", "fill_u32"), ("vector", "vector_add")]
        assert metrics.launches[("vector", "fill_u32")] == 3
        assert metrics.gpu_ms[("vector", "fill_u32")] >= 0.0
        table = metrics.table()
        assert "vector.fill_u32" in table and "vector.vector_add" in table


def test_debug_sync_kernels_names_the_failing_launch_on_the_fake() -> None:
    """On the fake a kernel can fail without poisoning the process; see the subprocess test for CUDA."""

    @kernel_implementation("vector", "fill_u32")
    def broken(launch: object, p: np.ndarray, n: np.uint32, value: np.uint32) -> None:
        raise RuntimeError("boom")

    with open_backend("fake", settings=SETTINGS.updated(debug_sync_kernels=True)) as gpu:
        registry = gpu.load_modules(shipped_modules("vector"))
        gpu.add_kernel_implementations(broken)
        buf = gpu.alloc(64)
        with pytest.raises(MetraleError, match=r"launch of vector.fill_u32<<<\(1, 1, 1\), \(16, 1, 1\)>>>") as info:
            gpu.launch(registry.kernel("vector", "fill_u32"), 1, 16, [buf, np.uint32(16), np.uint32(1)])
        assert info.value.name == "CUDA_ERROR_LAUNCH_FAILED" and "boom" in str(info.value)


def test_fake_without_an_implementation_says_how_to_register() -> None:
    image = b".version 8.0\n.target sm_80\n.address_size 64\n.visible .entry mine(.param .u64 p)\n{ ret; }\n"
    with open_backend("fake", settings=SETTINGS.updated(redzone=0)) as gpu:
        kernel = gpu.load_modules({"app": image}).kernel("app", "mine")
        with pytest.raises(MetraleError, match="kernel_implementation") as info:
            gpu.launch(kernel, 1, 1, [gpu.alloc(8)])
        assert "add_kernel_implementations" in str(info.value)

        calls: list[tuple[int, int]] = []

        @kernel_implementation("app", "mine")
        def mine(launch: object, p: np.ndarray) -> None:
            calls.append((len(p), launch.threads))  # type: ignore[attr-defined]
            p[:8] = 1

        gpu.add_kernel_implementations(mine)
        buf = gpu.alloc(8)
        gpu.launch(kernel, 2, 3, [buf])
        gpu.synchronize()
        assert calls == [(8, 6)]


def test_fake_compute_capability_is_a_setting() -> None:
    with open_backend("fake", settings=SETTINGS.updated(fake_compute_capability="7.0")) as gpu:
        assert gpu.compute_capability() == (7, 0)
        with pytest.raises(ArchitectureError, match=r"capability 7\.0"):
            gpu.load_modules(shipped_modules())


FAULT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from metrale_core import DeviceFaultError, MetraleSettings, open_backend
    from metrale_core.kernels import shipped_modules

    name, debug = sys.argv[1], sys.argv[2] == "1"
    report = {}
    gpu = open_backend(name, settings=MetraleSettings(debug_sync_kernels=debug))
    registry = gpu.load_modules(shipped_modules())
    buf = gpu.alloc(256)
    gpu.launch(registry.kernel("vector", "fill_u32"), 1, 64, [buf, np.uint32(64), np.uint32(1)])
    try:
        gpu.launch(registry.kernel("fault", "write_to"), 1, 1, [0x10, np.uint32(7)])
        gpu.synchronize()
    except DeviceFaultError as exc:
        report["first"] = [type(exc).__name__, exc.name, str(exc)]
    try:
        gpu.alloc(64)
    except DeviceFaultError as exc:
        report["later"] = [type(exc).__name__, exc.name, str(exc)]
    report["faulted"] = gpu.faulted is not None
    gpu.close()
    gpu.close()
    report["closed"] = True
    print(json.dumps(report))
    """
)


@pytest.mark.parametrize("debug", [True, False], ids=["debug_sync_kernels", "next_call"])
def test_faulting_kernel_in_a_subprocess(backend_name: str, debug: bool) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    out = subprocess.run(
        [sys.executable, "-c", FAULT_SCRIPT, backend_name, "1" if debug else "0"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    kind, name, text = report["first"]
    assert kind == "DeviceFaultError" and name in {"CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED"}, report
    assert "fault.write_to<<<(1, 1, 1), (1, 1, 1)>>>(0x10, 7)" in text
    if debug:
        assert text.startswith("launch of fault.write_to"), text
    later_kind, _, later = report["later"]
    assert later_kind == "DeviceFaultError" and "fault.write_to" in later
    assert report["faulted"] and report["closed"]
    assert "Traceback" not in out.stderr


def test_add_kernel_implementations_takes_records_only(fake: GpuBackend) -> None:
    with pytest.raises(InvalidArgumentError, match="kernel_implementation"):
        fake.add_kernel_implementations(print)  # type: ignore[arg-type]


def test_graph_refuses_to_launch_after_its_modules_unload(gpu: GpuBackend) -> None:
    registry = gpu.load_modules(shipped_modules("vector"))
    buf = gpu.alloc(256)
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    gpu.launch(registry.kernel("vector", "fill_u32"), 1, 64, [buf, np.uint32(64), np.uint32(1)], stream=stream)
    exe = gpu.end_capture(stream).instantiate()
    exe.launch(stream)
    registry.close()
    with pytest.raises(MetraleError, match="unloaded"):
        exe.launch(stream)


def test_a_graph_launch_after_its_registry_closed_is_backend_closed_as_an_eager_one(fake: GpuBackend) -> None:
    """Both launches name the closed registry with one error type (the graph's was a bare ``MetraleError``)."""
    registry = fake.load_modules(shipped_modules("vector"))
    fill = registry.kernel("vector", "fill_u32")
    buf = fake.alloc(256)
    stream = fake.create_stream()
    fake.begin_capture(stream)
    fake.launch(fill, 1, 64, [buf, np.uint32(64), np.uint32(1)], stream=stream)
    exe = fake.end_capture(stream).instantiate()
    registry.close()
    with pytest.raises(BackendClosedError, match="registry"):
        fake.launch(fill, 1, 64, [buf, np.uint32(64), np.uint32(1)], stream=stream)
    with pytest.raises(BackendClosedError, match="unloaded"):
        exe.launch(stream)
    assert not fake.closed


def test_fake_fill_past_the_allocation_faults() -> None:
    with open_backend("fake", settings=SETTINGS.updated(redzone=0, debug_sync_kernels=True)) as gpu:
        registry = gpu.load_modules(shipped_modules("vector"))
        buf = gpu.alloc(64)
        with pytest.raises(MetraleError) as info:
            gpu.launch(registry.kernel("vector", "fill_u32"), 1, 32, [buf, np.uint32(17), np.uint32(1)])
        assert info.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert str(info.value).count("[CUDA_ERROR_ILLEGAL_ADDRESS (700)]") == 1


def test_fake_misaligned_store_faults_as_on_a_gpu() -> None:
    """A u32 store at an address that is not a multiple of 4: CUDA_ERROR_MISALIGNED_ADDRESS on the
    H200 (seen when an arena piece with align=1 reached fill_u32), and the same on the fake."""
    with open_backend("fake", settings=SETTINGS.updated(redzone=0, debug_sync_kernels=True)) as gpu:
        fill = gpu.load_modules(shipped_modules("vector")).kernel("vector", "fill_u32")
        arena = gpu.create_arena(4096)
        arena.alloc(1, align=1)
        piece = arena.alloc(64, align=1)
        assert piece.ptr % 4 == 1
        with pytest.raises(MetraleError) as info:
            gpu.launch(fill, 1, 32, [piece, np.uint32(4), np.uint32(1)])
        assert info.value.name == "CUDA_ERROR_MISALIGNED_ADDRESS"


def test_preflight_cli_keeps_files_with_one_stem_apart(tmp_path: Path) -> None:
    ok = shipped_modules("vector")["vector"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "vector.ptx").write_bytes(ok.replace(b".target sm_75", b".target sm_200"))
    (tmp_path / "b" / "vector.ptx").write_bytes(ok)
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    env["METRALE_BACKEND"] = "fake"
    out = subprocess.run(
        [sys.executable, "-m", "metrale_core", "preflight", str(tmp_path / "a" / "vector.ptx"),
         str(tmp_path / "b" / "vector.ptx")],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert out.returncode == 1 and "1 ok, 1 refused" in out.stdout, out.stdout + out.stderr


def test_timed_launches_do_not_pile_up() -> None:
    with open_backend("fake", settings=SETTINGS.updated(kernel_timing=True)) as gpu:
        fill = gpu.load_modules(shipped_modules("vector")).kernel("vector", "fill_u32")
        buf = gpu.alloc(64)
        metrics = gpu.run_metrics()  # the live metrics object: pending grows as timed launches are issued
        for _ in range(5000):
            gpu.launch(fill, 1, 16, [buf, np.uint32(16), np.uint32(1)])
            assert len(metrics.pending) <= 4097, "finished timings are resolved as launches go"
        assert len(gpu.run_metrics().pending) == 0
        assert gpu.run_metrics().launches[("vector", "fill_u32")] == 5000
        assert ("vector", "fill_u32") in gpu.run_metrics().gpu_ms


def test_handles_close_quietly_after_a_device_fault() -> None:
    with open_backend("fake", settings=SETTINGS) as gpu:
        stream, event = gpu.create_stream(), gpu.create_event()
        assert isinstance(gpu, FaultInjecting)
        gpu.inject_fault("synchronize", code="CUDA_ERROR_ILLEGAL_ADDRESS")
        with pytest.raises(MetraleError):
            gpu.synchronize()
        assert gpu.faulted is not None
        stream.close()
        event.close()
        assert gpu.ledger_probe().live_count() == 0
