"""``FakeSettings``: the fake backend's own settings, read from ``METRALE_FAKE_*``.

Contributed through the ``metrale_settings`` hook, so each field is also a
keyword and attribute of [`MetraleSettings`][metrale_core.MetraleSettings] with the
prefix ``fake_`` (``MetraleSettings(fake_memory_bytes="1 MiB")``, as ever).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from metrale_core.plugin import PluginSettings, Size

__all__ = ["FakeSettings"]


class FakeSettings(PluginSettings):
    """The fake device's capacity, kind, compute capability, scheduling and address reuse."""

    model_config: ClassVar[SettingsConfigDict] = SettingsConfigDict(env_prefix="METRALE_FAKE_")

    memory_bytes: Size = Field(
        16 << 30, gt=0,
        description="The fake device's capacity; an allocation past it raises `OutOfMemoryError`.",
    )
    device_count: int = Field(
        1, ge=1, le=64,
        description="How many fake devices there are, each with its own capacity and address range. The process "
        "sees those `CUDA_VISIBLE_DEVICES` lists (all where it is unset, or `follow_visible_devices` is off), ordinals "
        "from 0; opening a higher ordinal is refused as CUDA refuses it.",
    )
    follow_visible_devices: bool = Field(
        True,
        description="The fake shows only the devices `CUDA_VISIBLE_DEVICES` lists, renumbered from 0, as the driver "
        "does (indexes, or `FAKE-` UUIDs), so an engine's worker code runs on the fake as on a GPU host. Off, it shows "
        "its `device_count` devices whatever the variable says (a GPU host whose variable names real GPUs).",
    )
    peer_access: bool = Field(
        True,
        description="Whether two fake devices can reach each other directly: off, `enable_peer_access` between two "
        "ordinals is refused with `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED` (`copy_peer` still copies, as CUDA does "
        "through the host).",
    )
    integrated: bool = Field(
        False,
        description="The fake reports an integrated device, so `memory_info().effective_free` follows the host's "
        "`MemAvailable`.",
    )
    compute_capability: str = Field(
        "9.0",
        pattern=r"^\d+\.\d+$",
        description="The compute capability the fake reports, `major.minor`; PTX images are checked against it.",
    )
    multiprocessors: int = Field(
        132, gt=0,
        description="The multiprocessors the fake reports (an H200's 132): `backend.n_tile` chooses tiles for them.",
    )
    shared_memory_per_multiprocessor: Size = Field(
        233472, gt=0,
        description="The shared memory per multiprocessor the fake reports (an H200's 228 KiB): a tensor map's box "
        "must fit in it, as the driver checks.",
    )
    defer: bool = Field(
        False,
        description="The fake runs stream work only when it must (a synchronize, a query, a pageable copy, "
        "a free), so a missing synchronization reads stale data as on a GPU.",
    )
    reuse_addresses: bool = Field(
        True,
        description="A freed device address comes back at once, as CUDA's allocator hands it out again: a new "
        "allocation (device, managed, arena or wrapped memory) takes the most recently freed range of its size "
        "class (its size plus a 4 KiB gap, rounded up to 256 bytes), so a stale pointer reaches the new "
        "allocation. Off, as the fake was before, every device allocation gets a fresh address and a stale "
        "device pointer lies outside any allocation. Pinned host addresses come back either way.",
    )
