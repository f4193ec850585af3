"""The shipped red-zone kernels on every backend: ``redzone.redzone_scan``, ``redzone.redzone_verdict`` and
``fault.write_u8``, launched through the public kernel API on zones made by hand.

A "zone" here is a sub-range of one big buffer set to the fill byte, at an unaligned start and of any
length; the bytes just before and just after every zone are left changed, so a kernel that reads one
byte outside its zone reports a clean zone as changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from metrale_core import DeviceBuffer, GpuBackend, Kernel, KernelRegistry
from metrale_core.kernels import shipped_modules

# every test here runs kernels
pytestmark = pytest.mark.needs("kernels")

FILL = 0xA5
LENGTHS = (1, 3, 15, 16, 17, 100, 4096, 4099)
MISALIGNMENTS = (0, 1, 7, 15)  # start % 16
GRID = 1024  # the grid metrale launches the verdict kernel with
BLOCK = 256
VERSION = 0x1234_5678_9ABC_DEF0
SLOT_SPARE = 0x5A5A_5A5A_5A5A_5A5A  # slot[3], which the verdict leaves alone


@pytest.fixture
def modules(gpu: GpuBackend) -> Iterator[KernelRegistry]:
    with gpu.load_modules(shipped_modules("redzone", "fault")) as registry:
        yield registry


@dataclasses.dataclass(frozen=True)
class Zone:
    """One zone: ``offset`` into the big buffer, ``length`` bytes, and the offsets (from the zone's
    start) planted with a changed byte."""

    offset: int
    length: int
    planted: tuple[int, ...] = ()

    @property
    def expected(self) -> int:
        """What ``redzone_scan`` writes for it: 0 when clean, else the first changed offset + 1."""
        return min(self.planted) + 1 if self.planted else 0


class Zones:
    """Zones laid out in one big buffer set to ``fill``, each bordered by changed bytes."""

    def __init__(self, gpu: GpuBackend, fill: int, layout: Sequence[tuple[int, int, tuple[int, ...]]]) -> None:
        """``layout``: (start % 16, length, planted offsets) per zone."""
        self.gpu, self.fill = gpu, fill
        zones: list[Zone] = []
        cursor = 64
        for misalignment, length, planted in layout:
            start = (cursor + 15) // 16 * 16 + misalignment
            zones.append(Zone(start, length, planted))
            cursor = start + length + 2
        self.zones = zones
        self.nbytes = cursor + 64
        self.buf = gpu.alloc(self.nbytes)
        image = np.full(self.nbytes, fill ^ 0xFF, dtype=np.uint8)  # every byte outside a zone changed
        for zone in zones:
            image[zone.offset:zone.offset + zone.length] = fill
            for k, at in enumerate(zone.planted):
                image[zone.offset + at] = fill ^ (0x01, 0x80, 0x5A)[k % 3]  # one bit, the top bit, several
        gpu.copy_to_device(self.buf, image)
        self.table = gpu.alloc(max(16 * len(zones), 16))
        if zones:
            gpu.copy_to_device(self.table, self.pairs())

    def pairs(self) -> np.ndarray:
        """The zone table: (address, length) of u64 per zone."""
        rows = [(self.buf.ptr + z.offset, z.length) for z in self.zones]
        return np.array(rows, dtype=np.uint64).reshape(len(self.zones), 2)

    def set_byte(self, zone: int, at: int, value: int) -> None:
        self.gpu.memset(self.buf, value, offset=self.zones[zone].offset + at, nbytes=1)

    @property
    def bad(self) -> int:
        return sum(1 for z in self.zones if z.planted)


def _scan(gpu: GpuBackend, modules: KernelRegistry, zones: Zones, fill: int | None = None) -> list[int]:
    n = len(zones.zones)
    result = gpu.alloc(4 * n)
    gpu.memset(result, 0xEE)  # every word written by the kernel
    scan = modules.kernel("redzone", "redzone_scan")
    gpu.launch(scan, n, BLOCK, [zones.table, np.uint32(n), np.uint32(zones.fill if fill is None else fill), result])
    out = np.empty(n, dtype=np.uint32)
    gpu.copy_to_host(out, result)
    gpu.free(result)
    return [int(v) for v in out]


class Verdict:
    """A verdict kernel's descriptor, state (zeroed once) and slot (an ordinary device buffer here)."""

    def __init__(self, gpu: GpuBackend, modules: KernelRegistry) -> None:
        self.gpu = gpu
        self.kernel: Kernel = modules.kernel("redzone", "redzone_verdict")
        self.desc, self.state, self.slot = gpu.alloc(32), gpu.alloc(16), gpu.alloc(32)
        gpu.memset(self.state, 0)
        gpu.copy_to_device(self.slot, np.array([0, 0, 0, SLOT_SPARE], dtype=np.uint64))

    def describe(self, table: int, count: int, version: int, fill: int) -> None:
        self.gpu.copy_to_device(self.desc, np.array([table, count, version, fill], dtype=np.uint64))

    def describe_zones(self, zones: Zones, version: int = VERSION) -> None:
        # bits above the low 8 of the fill word are not the fill
        self.describe(zones.table.ptr, len(zones.zones), version, zones.fill | 0x3C00)

    def run(self, grid: int = GRID, block: int = BLOCK) -> tuple[int, int, int]:
        """Launch it; the slot's (bad zones, version, sequence number), after checking what else it leaves."""
        self.gpu.launch(self.kernel, grid, block, [self.desc, self.state, self.slot])
        slot = np.empty(4, dtype=np.uint64)
        self.gpu.copy_to_host(slot, self.slot)
        state = np.empty(2, dtype=np.uint64)
        self.gpu.copy_to_host(state, self.state)
        assert int(slot[3]) == SLOT_SPARE, "slot[3] is not the verdict's"
        assert int(state[0]) >> 32 == 0, "the bad-zone accumulator is reset for the next launch"
        assert int(state[1]) == int(slot[2]), "the sequence number is kept in state[1]"
        return int(slot[0]), int(slot[1]), int(slot[2])


def _every_shape(planted: str) -> list[tuple[int, int, tuple[int, ...]]]:
    """A zone of every length at every misalignment, planted at the first, a middle or the last byte
    (``planted``: "first", "middle", "last", "none")."""
    def at(n: int) -> tuple[int, ...]:
        return {"first": (0,), "middle": (n // 2,), "last": (n - 1,), "none": ()}[planted]

    return [(m, n, at(n)) for n in LENGTHS for m in MISALIGNMENTS]


# -- redzone_scan ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fill", [FILL, 0x00, 0xFF])
def test_scan_of_clean_zones_gives_zero(gpu: GpuBackend, modules: KernelRegistry, fill: int) -> None:
    zones = Zones(gpu, fill, _every_shape("none"))
    assert _scan(gpu, modules, zones) == [0] * len(zones.zones)


@pytest.mark.parametrize("planted", ["first", "middle", "last"])
def test_scan_finds_the_changed_byte_at_its_offset(gpu: GpuBackend, modules: KernelRegistry, planted: str) -> None:
    layout = []
    for shape in _every_shape(planted):  # a clean zone after each planted one
        layout += [shape, (shape[0], shape[1], ())]
    zones = Zones(gpu, FILL, layout)
    assert _scan(gpu, modules, zones) == [z.expected for z in zones.zones]


def test_scan_reports_the_first_of_several_changed_bytes(gpu: GpuBackend, modules: KernelRegistry) -> None:
    """Changed bytes in the head, the 16-byte middle and the tail of one zone, and several in one word:
    the least offset wins, wherever the others lie."""
    layout: list[tuple[int, int, tuple[int, ...]]] = []
    for m in MISALIGNMENTS:
        head = (16 - m) % 16
        layout += [
            (m, 4099, (4098, 2000, 1999, head + 17)),  # middle words only, the first in the second word
            (m, 4099, (4098, max(head - 1, 0), 3000)),  # head (or the first word) first
            (m, 4099, (4098, 4097, 4096)),  # tail bytes only
            (m, 100, (99, 60, 61, 62, 63)),
            (m, 17, (16, 9, 3)),
            (m, 4096, tuple(range(4095, 255, -256))),  # one per thread's word: the block's minimum
        ]
    zones = Zones(gpu, FILL, layout)
    assert _scan(gpu, modules, zones) == [z.expected for z in zones.zones]


def test_scan_takes_the_low_byte_of_fill(gpu: GpuBackend, modules: KernelRegistry) -> None:
    zones = Zones(gpu, FILL, [(3, 100, ()), (5, 100, (40,))])
    assert _scan(gpu, modules, zones, fill=0x4200 | FILL) == [0, 41]


def test_scan_sees_a_byte_written_by_a_kernel(gpu: GpuBackend, modules: KernelRegistry) -> None:
    zones = Zones(gpu, FILL, [(9, 4099, ())])
    write = modules.kernel("fault", "write_u8")
    gpu.launch(write, 1, 1, [zones.buf.ptr + zones.zones[0].offset + 1234, np.uint32(0)])
    assert _scan(gpu, modules, zones) == [1235]


# -- redzone_verdict ------------------------------------------------------------------------------


def test_verdict_of_clean_zones_is_zero(gpu: GpuBackend, modules: KernelRegistry) -> None:
    zones = Zones(gpu, FILL, _every_shape("none"))
    verdict = Verdict(gpu, modules)
    verdict.describe_zones(zones)
    assert verdict.run() == (0, VERSION, 1)


@pytest.mark.parametrize("planted", ["first", "middle", "last"])
def test_verdict_counts_the_changed_zones(gpu: GpuBackend, modules: KernelRegistry, planted: str) -> None:
    layout = []
    for shape in _every_shape(planted):
        layout += [shape, (shape[0], shape[1], ())]
    zones = Zones(gpu, FILL, layout)
    verdict = Verdict(gpu, modules)
    verdict.describe_zones(zones)
    assert verdict.run() == (len(_every_shape(planted)), VERSION, 1)


def test_verdict_of_no_zones(gpu: GpuBackend, modules: KernelRegistry) -> None:
    verdict = Verdict(gpu, modules)
    verdict.describe(0, 0, 7, FILL)
    assert verdict.run() == (0, 7, 1)
    assert verdict.run(grid=1) == (0, 7, 2)


def test_verdicts_of_successive_launches(gpu: GpuBackend, modules: KernelRegistry) -> None:
    """Each launch leaves one verdict with the next sequence number; the accumulator starts again at
    zero, so a fixed byte gives a clean verdict."""
    zones = Zones(gpu, FILL, [(1, 100, ()), (2, 4099, (4000,)), (3, 17, ()), (4, 3, (1,)), (0, 16, ())])
    verdict = Verdict(gpu, modules)
    verdict.describe_zones(zones, version=1)
    assert verdict.run() == (2, 1, 1)
    assert verdict.run() == (2, 1, 2)
    zones.set_byte(1, 4000, FILL)
    verdict.describe_zones(zones, version=2)
    assert verdict.run() == (1, 2, 3)
    zones.set_byte(3, 1, FILL)
    assert verdict.run() == (0, 2, 4)
    zones.set_byte(2, 16, FILL ^ 1)
    assert verdict.run() == (1, 2, 5)


@pytest.mark.parametrize("count", [1, 5, 1024, 3000])
def test_verdict_is_the_same_for_any_grid_and_block(gpu: GpuBackend, modules: KernelRegistry, count: int) -> None:
    """Fewer zones than blocks, as many, and more (every zone walked by a block's stride)."""
    rng = np.random.default_rng(count)
    lengths = [int(rng.choice(LENGTHS[:6])) for _ in range(count)]
    marked = set(rng.choice(count, size=max(count // 7, 1), replace=False).tolist()) | {0, count - 1}
    marked |= {z for z in (1023, 1024, 2047, 2048) if z < count}  # the first and last of a stride
    layout = []
    for z, length in enumerate(lengths):
        planted = (int(rng.integers(length)),) if z in marked else ()
        layout.append((int(rng.integers(16)), length, planted))
    zones = Zones(gpu, FILL, layout)
    expected = (len(marked), VERSION, 1)
    for grid, block in [(GRID, BLOCK), (1, BLOCK), (7, 64), (GRID, 32), (3, 1024)]:
        verdict = Verdict(gpu, modules)
        verdict.describe_zones(zones)
        assert verdict.run(grid, block) == expected, (grid, block)
    assert _scan(gpu, modules, zones) == [z.expected for z in zones.zones]


def test_verdict_reads_the_descriptor_at_each_launch(gpu: GpuBackend, modules: KernelRegistry) -> None:
    """Its parameters never change (as in a captured graph): a new table, count or fill in the
    descriptor is what the next launch checks."""
    a = Zones(gpu, FILL, [(1, 100, (5,)), (2, 100, ())])
    b = Zones(gpu, 0x00, [(3, 4099, (7,)), (4, 15, (14,)), (5, 1, (0,))])
    verdict = Verdict(gpu, modules)
    verdict.describe_zones(a, version=10)
    assert verdict.run() == (1, 10, 1)
    verdict.describe_zones(b, version=11)
    assert verdict.run() == (3, 11, 2)
    verdict.describe(b.table.ptr, 1, 12, 0x00)
    assert verdict.run() == (1, 12, 3)
    verdict.describe(a.table.ptr, 2, 13, FILL ^ 0xFF)  # every byte differs from this fill
    assert verdict.run() == (2, 13, 4)


# -- write_u8 -------------------------------------------------------------------------------------


def test_write_u8_writes_one_byte(gpu: GpuBackend, modules: KernelRegistry) -> None:
    buf: DeviceBuffer = gpu.alloc(64)
    gpu.memset(buf, 0x33)
    write = modules.kernel("fault", "write_u8")
    gpu.launch(write, 1, 1, [buf.ptr + 13, np.uint32(0xC7)])
    gpu.launch(write, 2, 64, [buf.ptr + 50, np.uint32(0x1F0)])  # many threads, one store; the low byte
    out = np.empty(64, dtype=np.uint8)
    gpu.copy_to_host(out, buf)
    expected = np.full(64, 0x33, dtype=np.uint8)
    expected[13], expected[50] = 0xC7, 0xF0
    np.testing.assert_array_equal(out, expected)
