"""The bad-input table: bad calls, the typed error each must raise, and a check that each changes nothing."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from .. import (
    BackendNotFoundError,
    CaptureError,
    DeviceBuffer,
    GpuBackend,
    HostBuffer,
    InvalidArgumentError,
    InvalidBufferError,
    MetraleError,
    Stream,
    open_backend,
)

__all__ = ["BAD_INPUTS", "BadInput", "BadInputFixture", "bad_input_fixture", "check_bad_input"]


@dataclasses.dataclass(slots=True)
class BadInputFixture:
    """What a bad-input case may use: a backend and a few handles of it."""

    gpu: GpuBackend
    buf: DeviceBuffer
    arena: DeviceBuffer
    freed: DeviceBuffer
    host: HostBuffer
    foreign_stream: Stream
    #: Freed just before ``buf`` was allocated with its size: where the allocator hands freed addresses out
    #: again (CUDA at once, the fake most recently freed first), a stale handle over ``buf``'s own address.
    reused: DeviceBuffer
    #: A freed host buffer of ``host``'s size, freed just before ``host`` was allocated (so, likely, its address).
    freed_host: HostBuffer


@dataclasses.dataclass(frozen=True, slots=True)
class BadInput:
    """One bad call and the error it must raise, changing nothing."""

    name: str
    call: Callable[[BadInputFixture], Any]
    error: type[MetraleError]


def _cases() -> tuple[BadInput, ...]:
    buf_err, arg_err = InvalidBufferError, InvalidArgumentError
    return (
        BadInput("alloc(0)", lambda f: f.gpu.alloc(0), buf_err),
        BadInput("alloc(-1)", lambda f: f.gpu.alloc(-1), buf_err),
        BadInput("alloc(1.5)", lambda f: f.gpu.alloc(1.5), buf_err),  # type: ignore[arg-type]
        BadInput("alloc(True)", lambda f: f.gpu.alloc(True), buf_err),
        BadInput("alloc('64')", lambda f: f.gpu.alloc("64"), buf_err),  # type: ignore[arg-type]
        BadInput("alloc_managed(0)", lambda f: f.gpu.alloc_managed(0), buf_err),
        BadInput("alloc_arena(-5)", lambda f: f.gpu.alloc_arena(-5), buf_err),
        BadInput("alloc_host(0)", lambda f: f.gpu.alloc_host(0), buf_err),
        BadInput("alloc(1 << 64): past 64 bits", lambda f: f.gpu.alloc(1 << 64), arg_err),
        BadInput("alloc(64, stacklevel=0)", lambda f: f.gpu.alloc(64, stacklevel=0), arg_err),
        BadInput("alloc_managed(64, stacklevel='2')",
                 lambda f: f.gpu.alloc_managed(64, stacklevel="2"), arg_err),  # type: ignore[arg-type]
        BadInput("alloc_host(1 << 70): past 64 bits", lambda f: f.gpu.alloc_host(1 << 70), arg_err),
        BadInput("free(freed)", lambda f: f.gpu.free(f.freed), buf_err),
        BadInput("free(arena)", lambda f: f.gpu.free(f.arena), buf_err),
        BadInput("free(42)", lambda f: f.gpu.free(42), buf_err),  # type: ignore[arg-type]
        BadInput("free_arena(device)", lambda f: f.gpu.free_arena(f.buf), buf_err),
        BadInput("memset value 300", lambda f: f.gpu.memset(f.buf, 300), arg_err),
        BadInput("memset value -1", lambda f: f.gpu.memset(f.buf, -1), arg_err),
        BadInput("memset value 'a'", lambda f: f.gpu.memset(f.buf, "a"), arg_err),  # type: ignore[arg-type]
        BadInput("memset past end", lambda f: f.gpu.memset(f.buf, 1, offset=f.buf.nbytes, nbytes=1), buf_err),
        BadInput("memset nbytes=0", lambda f: f.gpu.memset(f.buf, 1, nbytes=0), buf_err),
        BadInput("copy_device nbytes=-1", lambda f: f.gpu.copy_device(f.buf, f.buf, nbytes=-1), buf_err),
        BadInput("memset negative offset", lambda f: f.gpu.memset(f.buf, 1, offset=-1), arg_err),
        BadInput("memset raw pointer without nbytes", lambda f: f.gpu.memset(f.buf.ptr, 1), arg_err),
        BadInput("memset on another backend's stream", lambda f: f.gpu.memset(f.buf, 1, stream=f.foreign_stream),
                 arg_err),
        BadInput("memset of a freed buffer", lambda f: f.gpu.memset(f.freed, 1), buf_err),
        BadInput("memset of a stale handle over a reused address", lambda f: f.gpu.memset(f.reused, 1), buf_err),
        BadInput("copy_to_device through a stale handle over a reused address",
                 lambda f: f.gpu.copy_to_device(f.reused, b"\x01" * 8), buf_err),
        BadInput("copy_device into a stale handle over a reused address",
                 lambda f: f.gpu.copy_device(f.reused, f.arena, nbytes=8), buf_err),
        BadInput("free of a stale handle over a reused address", lambda f: f.gpu.free(f.reused), buf_err),
        BadInput("copy_to_host into a freed host buffer whose address came back",
                 lambda f: f.gpu.copy_to_host(f.freed_host, f.buf), buf_err),
        BadInput("memset raw pointer outside any allocation", lambda f: f.gpu.memset(0x10, 1, nbytes=1), arg_err),
        BadInput("copy_to_device too long",
                 lambda f: f.gpu.copy_to_device(f.buf, bytes(f.buf.nbytes + 1)), buf_err),
        BadInput("copy_to_device not a buffer", lambda f: f.gpu.copy_to_device(f.buf, 12), arg_err),
        BadInput("copy_to_host read-only destination", lambda f: f.gpu.copy_to_host(bytes(8), f.buf), arg_err),
        BadInput("copy_to_host past end", lambda f: f.gpu.copy_to_host(bytearray(2), f.buf, offset=f.buf.nbytes - 1),
                 buf_err),
        BadInput("copy_device past end", lambda f: f.gpu.copy_device(f.buf, f.buf, nbytes=f.buf.nbytes + 1), buf_err),
        BadInput("copy_device from a freed buffer", lambda f: f.gpu.copy_device(f.buf, f.freed, nbytes=1), buf_err),
        BadInput("copy_to_device on a stream that is not a Stream", lambda f: f.gpu.copy_to_device(
            f.buf, b"x", stream=object()), arg_err),  # type: ignore[arg-type]
        BadInput("end_capture on a stream not capturing", lambda f: f.gpu.end_capture(), CaptureError),
        BadInput("open_backend of an unknown name", lambda f: open_backend("no-such-backend"), BackendNotFoundError),
    )


#: At least twenty bad calls, each with its typed error; each must change nothing.
BAD_INPUTS: tuple[BadInput, ...] = _cases()


@contextlib.contextmanager
def bad_input_fixture(gpu: GpuBackend) -> Iterator[BadInputFixture]:
    """The handles the bad-input cases use, on ``gpu`` (a second backend of the same name gives the foreign stream)."""
    with open_backend(gpu.name, ordinal=gpu.ordinal, settings=gpu.settings) as other:
        freed = gpu.alloc(64)
        gpu.free(freed)
        reused = gpu.alloc(256)
        gpu.free(reused)
        buf = gpu.alloc(256)  # likely at reused's address
        gpu.memset(buf, 0x3C)
        freed_host = gpu.alloc_host(64)
        gpu.free(freed_host)
        yield BadInputFixture(
            gpu=gpu,
            buf=buf,
            arena=gpu.alloc_arena(128),
            freed=freed,
            host=gpu.alloc_host(64),  # likely at freed_host's address
            foreign_stream=other.create_stream(),
            reused=reused,
            freed_host=freed_host,
        )


def check_bad_input(fixture: BadInputFixture, case: BadInput) -> MetraleError:
    """Run ``case`` on ``fixture``; assert its error type and that nothing changed."""
    gpu = fixture.gpu
    probe = gpu.ledger_probe()
    records = probe.records()
    before = bytearray(fixture.buf.nbytes)
    gpu.copy_to_host(before, fixture.buf)
    try:
        case.call(fixture)
    except case.error as exc:
        error = exc
    except MetraleError as exc:
        raise AssertionError(f"{case.name}: expected {case.error.__name__}, got {type(exc).__name__}: {exc}") from exc
    else:
        raise AssertionError(f"{case.name}: expected {case.error.__name__}, but the call succeeded")
    assert str(error), f"{case.name}: the error has no message"
    assert probe.records() == records, f"{case.name}: the refused call changed the ledger"
    after = bytearray(fixture.buf.nbytes)
    gpu.copy_to_host(after, fixture.buf)
    assert after == before, f"{case.name}: the refused call changed the buffer's bytes"
    return error
