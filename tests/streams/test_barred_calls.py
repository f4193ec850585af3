"""The capture rule's lock-free bookkeeping: a capture that begins waits for the barred calls other
threads are inside, and refuses those that check after it began; ``close()`` waits for the calls
of other threads without a lock on their way in."""

from __future__ import annotations

import threading
import time

import pytest

from metrale_core import BackendClosedError, CaptureError, open_backend
from metrale_core._device.capture import Capture, call_entered, call_left, forbid_during_capture, may_wait


def test_a_capture_waits_for_a_barred_call_another_thread_is_inside() -> None:
    inside, release, began = threading.Event(), threading.Event(), threading.Event()

    def barred_call() -> None:
        call_entered()
        try:
            forbid_during_capture("alloc")
            inside.set()
            release.wait(5)
        finally:
            call_left()

    worker = threading.Thread(target=barred_call)
    worker.start()
    assert inside.wait(5)
    capture = Capture(owner=object())

    def start() -> None:
        capture.start()
        began.set()

    starter = threading.Thread(target=start)
    starter.start()
    time.sleep(0.05)
    assert not began.is_set(), "the capture began while another thread was inside a barred call"
    release.set()
    assert began.wait(5)
    worker.join(5)
    starter.join(5)
    try:
        call_entered()
        try:
            with pytest.raises(CaptureError):  # checked after the capture began: refused
                forbid_during_capture("free")
            assert capture.invalidated
            assert not may_wait()  # a wait metrale chooses is only put off
        finally:
            call_left()
    finally:
        capture.finish()
    call_entered()
    try:
        forbid_during_capture("alloc")  # the capture is over: allowed again
        assert may_wait()
    finally:
        call_left()


def test_close_waits_for_a_call_another_thread_is_inside() -> None:
    gpu = open_backend("fake")
    ctx = gpu._ctx
    inside, release = threading.Event(), threading.Event()

    def call() -> None:
        ctx.enter()
        try:
            inside.set()
            release.wait(5)
        finally:
            ctx.leave()

    worker = threading.Thread(target=call)
    worker.start()
    assert inside.wait(5)
    closed = threading.Event()

    def close() -> None:
        gpu.close()
        closed.set()

    closer = threading.Thread(target=close)
    closer.start()
    time.sleep(0.05)
    assert not closed.is_set(), "close() returned while another thread was inside a call"
    release.set()
    assert closed.wait(5)
    worker.join(5)
    closer.join(5)
    with pytest.raises(BackendClosedError):
        gpu.alloc(16)
