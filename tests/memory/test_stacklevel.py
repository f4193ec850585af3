"""Call sites through an application's helpers: ``stacklevel`` on the allocating calls, and ``site_skip`` naming
modules (``myapp.gpu``) as well as packages; in both builds."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from metrale_core import GpuBackend, InvalidArgumentError, MetraleSettings, open_backend

BUILDS = pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])

HELPERS = '''\
def scratch(gpu, n, level):
    return gpu.alloc(n, stacklevel=level)


def managed(gpu, n):
    return gpu.alloc_managed(n, stacklevel=2)


def block(gpu, n):
    return gpu.alloc_arena(n, stacklevel=2)


def piece(arena, n):
    return arena.alloc(n, stacklevel=2)


def plain(gpu, n):
    return gpu.alloc(n)


def pooled(pool, n):
    return pool.alloc(n, stacklevel=2)
'''


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A package ``stackapp`` with a module ``stackapp.gpu`` of allocating helpers."""
    package = tmp_path / "stackapp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "gpu.py").write_text(HELPERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import stackapp.gpu  # type: ignore[import-not-found]

    yield stackapp.gpu
    for name in ("stackapp", "stackapp.gpu"):
        sys.modules.pop(name, None)


def _open(pure: bool, **changes: object) -> GpuBackend:
    return open_backend("fake", settings=MetraleSettings(pure=pure, **changes))  # type: ignore[arg-type]


def _line() -> int:
    return sys._getframe(1).f_lineno


@BUILDS
def test_stacklevel_2_names_the_helper_s_caller(app: object, pure: bool) -> None:
    with _open(pure) as gpu:
        here = Path(__file__).name
        a, line_a = app.scratch(gpu, 64, 2), _line()  # type: ignore[attr-defined]
        b = app.scratch(gpu, 64, 1)  # type: ignore[attr-defined]
        c, line_c = app.managed(gpu, 64), _line()  # type: ignore[attr-defined]
        d, line_d = app.block(gpu, 64), _line()  # type: ignore[attr-defined]
        assert a.site.endswith(f"{here}:{line_a}") and c.site.endswith(f"{here}:{line_c}"), (a.site, c.site)
        assert d.site.endswith(f"{here}:{line_d}")
        assert b.site.endswith("stackapp/gpu.py:2")  # 1: the helper's own line, as before
        with gpu.create_arena(4096) as arena:
            p, line_p = app.piece(arena, 64), _line()  # type: ignore[attr-defined]
            assert p.site.endswith(f"{here}:{line_p}")
        pool = gpu.create_pool()
        q, line_q = app.pooled(pool, 64), _line()  # type: ignore[attr-defined]
        assert q.site.endswith(f"{here}:{line_q}")
        pool.free(q)
        with pytest.raises(InvalidArgumentError, match="stacklevel"):
            pool.alloc(64, stacklevel=0)
        pool.close()
        far = app.scratch(gpu, 64, 10_000)  # type: ignore[attr-defined]
        farther = app.scratch(gpu, 64, 2**63)  # type: ignore[attr-defined]  # (past any index: no raw error)
        assert farther.site == far.site
        gpu.free(farther)
        assert far.site != "<unknown>:0"  # more levels than frames: the outermost one
        for buf in (a, b, c, far):
            gpu.free(buf)
        gpu.free_arena(d)


@BUILDS
def test_site_skip_names_a_module_prefix(app: object, pure: bool) -> None:
    with _open(pure, site_skip=("stackapp.gpu",)) as gpu:
        buf, line = app.plain(gpu, 64), _line()  # type: ignore[attr-defined]
        assert buf.site.endswith(f"{Path(__file__).name}:{line}"), buf.site
        gpu.free(buf)
    with _open(pure, site_skip=("stackapp.other",)) as gpu:  # another module of the package: not skipped
        buf = app.plain(gpu, 64)  # type: ignore[attr-defined]
        assert buf.site.endswith("stackapp/gpu.py:18"), buf.site
        gpu.free(buf)


def test_a_module_prefix_in_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_SITE_SKIP", "torch, myapp.gpu")
    assert MetraleSettings().site_skip == ("torch", "myapp.gpu")


@BUILDS
@pytest.mark.parametrize("level", [0, -1, 1.5, "2", True, None])
def test_a_bad_stacklevel_is_refused_and_changes_nothing(pure: bool, level: object) -> None:
    with _open(pure) as gpu:
        with pytest.raises(InvalidArgumentError, match="stacklevel"):
            gpu.alloc(64, stacklevel=level)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="stacklevel"):
            gpu.alloc_managed(64, stacklevel=level)  # type: ignore[arg-type]
        with gpu.create_arena(4096) as arena:
            with pytest.raises(InvalidArgumentError, match="stacklevel"):
                arena.alloc(64, stacklevel=level)  # type: ignore[arg-type]
            assert arena.used == 0
        assert gpu.live_alloc_len() == 0 and gpu.stats().alloc_count == 1  # (the arena's block)
