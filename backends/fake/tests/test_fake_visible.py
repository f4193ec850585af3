"""The fake reads CUDA_VISIBLE_DEVICES as the CUDA driver does, so an engine's worker code (Dask-CUDA's rotated
lists, Ray's assigned ids, UUIDs) runs on the fake as on a GPU host."""

from __future__ import annotations

import pytest

from metrale_core import BackendUnavailableError, MetraleSettings, device_count, open_backend
from metrale_fake._visible import fake_uuid, visible_devices


@pytest.mark.parametrize(("spec", "shown"), [
    (None, (0, 1, 2)),  # unset: every device, in order
    ("", ()),  # empty: none
    ("1,0", (1, 0)),  # renumbered from 0 in the order listed
    (" 2 , 0 ", (2, 0)),  # whitespace around entries
    ("1gpu2,0", (1, 0)),  # read as strtoul reads a number: its leading digits
    ("0,0,1", ()),  # a device listed twice: none at all
    ("1,0,1", ()),
    ("1,5,0", (1,)),  # past the last device ends the list
    ("1,-1,0", (1,)),  # so does a negative entry
    ("x,1", ()),  # an entry that is no number first: nothing shown
    ("0,FAKE-,1", (0,)),  # a UUID in a list of indexes ends it
    (fake_uuid(2), (2,)),  # a UUID whole
    (fake_uuid(1)[:13] + "," + fake_uuid(0), (1, 0)),  # or a unique prefix of one, as the driver takes GPU-…
    (fake_uuid(1) + ",0", (1,)),  # an index in a list of UUIDs ends it
    (fake_uuid(1) + "," + fake_uuid(1), ()),  # a UUID listed twice: none
    ("FAKE-", ()),  # no UUID at all
    ("MIG-0a1b,0", ()),
])
def test_cuda_visible_devices_reads_as_the_driver_reads_it(spec: str | None, shown: tuple[int, ...]) -> None:
    assert visible_devices(spec, 3) == shown


def test_a_worker_shown_1_0_opens_fake_device_1_as_its_ordinal_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    settings = MetraleSettings(fake_device_count=2)
    assert device_count("fake", settings=settings) == 2
    with open_backend("fake", settings=settings) as first, open_backend("fake", ordinal=1, settings=settings) as second:
        assert (first.origin.ordinal, first.origin.device_uuid) == (0, fake_uuid(1))
        assert (second.origin.ordinal, second.origin.device_uuid) == (1, fake_uuid(0))


def test_with_launch_shows_devices_as_the_variable_does() -> None:
    settings = MetraleSettings(fake_device_count=2).with_launch(cuda_visible_devices=fake_uuid(1))
    assert device_count("fake", settings=settings) == 1
    with open_backend("fake", settings=settings) as gpu:
        assert gpu.origin.device_uuid == fake_uuid(1)


def test_an_empty_list_shows_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    settings = MetraleSettings(fake_device_count=2)
    assert device_count("fake", settings=settings) == 0
    with pytest.raises(BackendUnavailableError, match="CUDA_ERROR_NO_DEVICE") as info:
        open_backend("fake", settings=settings)
    assert "CUDA_VISIBLE_DEVICES=''" in str(info.value)


def test_an_ordinal_past_the_devices_shown_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(BackendUnavailableError, match="CUDA_VISIBLE_DEVICES=1 shows 1") as info:
        open_backend("fake", ordinal=1, settings=MetraleSettings(fake_device_count=2))
    assert info.value.name == "CUDA_ERROR_INVALID_DEVICE"


def test_a_variable_naming_real_gpus_is_followed_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # a GPU host's, naming its fourth GPU
    with pytest.raises(BackendUnavailableError, match="METRALE_FAKE_FOLLOW_VISIBLE_DEVICES=0"):
        open_backend("fake", settings=MetraleSettings())
    settings = MetraleSettings(fake_follow_visible_devices=False, fake_device_count=2)
    assert device_count("fake", settings=settings) == 2
    with open_backend("fake", ordinal=1, settings=settings) as gpu:
        assert gpu.origin.device_uuid == fake_uuid(1)


def test_a_bad_launcher_variable_does_not_hide_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "-1")  # stops a placement, not a plain open
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with open_backend("fake", settings=MetraleSettings(fake_device_count=2)) as gpu:
        assert gpu.origin.device_uuid == fake_uuid(1)
