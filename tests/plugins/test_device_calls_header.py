"""The device calls' one C definition, ``metrale/device_calls.h`` (``metrale_core.plugin.get_include()``), as a
third-party backend uses it: a tiny C extension built against it here, as C and as C++ (the CUDA backend's
``_cdriver.pyx`` compiles as C++), fills the struct and hands it in a capsule; the core's compiled lane reads it and
calls it, and refuses a struct shorter than the header's least. docs/plugin-authors.md's sketch compiles too.

Built with the C compiler Python was built with (``sysconfig``'s ``CC`` and ``CXX``); skipped, saying so, only where
there is none (or no ``Python.h``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import re
import shlex
import shutil
import subprocess
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

import metrale_core.plugin
from metrale_core import GpuBackend, open_backend
from metrale_core.plugin import DEVICE_CALLS, RawDevice, get_include
from tests._support import MIB, SETTINGS, TEST_CAPACITY, DeviceCallsTable, compiled_twin

ROOT = Path(__file__).resolve().parents[2]
HEADER = Path(get_include()) / "metrale" / "device_calls.h"

#: A backend's device calls over a device's own methods (``alloc`` and ``free`` of ``"device"`` memory), counting
#: the calls; its ``layout()`` is what the header defines, as the C compiler reads it.
SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "metrale/device_calls.h"

typedef struct {
    metrale_device_calls_v1 calls;
    PyObject *device;
    long allocs, frees;
} probe;

static int probe_alloc(void *state, size_t nbytes, uintptr_t *ptr) {
    probe *self = (probe *)state;
    PyObject *got = PyObject_CallMethod(self->device, "alloc", "ns", (Py_ssize_t)nbytes, "device");
    unsigned long long address;
    if (got == NULL)
        return METRALE_DEVICE_CALLS_FAILED;
    address = PyLong_AsUnsignedLongLong(got);
    Py_DECREF(got);
    if (PyErr_Occurred())
        return METRALE_DEVICE_CALLS_FAILED;
    *ptr = (uintptr_t)address;
    self->allocs++;
    return METRALE_DEVICE_CALLS_DONE;
}

static int probe_free(void *state, uintptr_t ptr) {
    probe *self = (probe *)state;
    PyObject *got = PyObject_CallMethod(self->device, "free", "Ks", (unsigned long long)ptr, "device");
    if (got == NULL)
        return METRALE_DEVICE_CALLS_FAILED;
    Py_DECREF(got);
    self->frees++;
    return METRALE_DEVICE_CALLS_DONE;
}

/* the optional functions, for the header's helpers: never called */
static int probe_memset(void *state, uintptr_t ptr, int value, size_t nbytes, PyObject *stream) {
    (void)state, (void)ptr, (void)value, (void)nbytes, (void)stream;
    return METRALE_DEVICE_CALLS_DECLINED;
}
static int probe_graph_launch(void *state, PyObject *graph_exec, PyObject *stream) {
    (void)state, (void)graph_exec, (void)stream;
    return METRALE_DEVICE_CALLS_DECLINED;
}
static int probe_launch(void *state, PyObject *function, const unsigned int *shape, unsigned int shared_mem,
                        PyObject *stream, PyObject *args) {
    (void)state, (void)function, (void)shape, (void)shared_mem, (void)stream, (void)args;
    return METRALE_DEVICE_CALLS_DECLINED;
}

static void probe_drop(PyObject *capsule) {
    probe *self = (probe *)PyCapsule_GetPointer(capsule, METRALE_DEVICE_CALLS_CAPSULE);
    Py_XDECREF(self->device);
    PyMem_Free(self);
}

/* capsule(device, size=sizeof the struct): the device calls over device's alloc and free */
static PyObject *probe_capsule(PyObject *module, PyObject *args) {
    PyObject *device, *capsule;
    Py_ssize_t size = (Py_ssize_t)sizeof(metrale_device_calls_v1);
    probe *self;
    if (!PyArg_ParseTuple(args, "O|n", &device, &size))
        return NULL;
    self = (probe *)PyMem_Calloc(1, sizeof(probe));
    if (self == NULL)
        return PyErr_NoMemory();
    Py_INCREF(device);
    self->device = device;
    self->calls.size = (size_t)size;
    self->calls.state = self;
    self->calls.alloc = probe_alloc;
    self->calls.free = probe_free;
    capsule = PyCapsule_New(&self->calls, METRALE_DEVICE_CALLS_CAPSULE, probe_drop);
    if (capsule == NULL) {
        Py_DECREF(device);
        PyMem_Free(self);
    }
    return capsule;
}

/* counts(capsule): (allocs, frees) made through it */
static PyObject *probe_counts(PyObject *module, PyObject *capsule) {
    probe *self = (probe *)PyCapsule_GetPointer(capsule, METRALE_DEVICE_CALLS_CAPSULE);
    if (self == NULL)
        return NULL;
    return Py_BuildValue("(ll)", self->allocs, self->frees);
}

/* layout(): the struct's size and offsets, the least size, the capsule's name, the codes and the version */
static PyObject *probe_layout(PyObject *module, PyObject *unused) {
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:s,s:i,s:i,s:i,s:i}",
        "sizeof", (Py_ssize_t)sizeof(metrale_device_calls_v1),
        "size", (Py_ssize_t)offsetof(metrale_device_calls_v1, size),
        "state", (Py_ssize_t)offsetof(metrale_device_calls_v1, state),
        "alloc", (Py_ssize_t)offsetof(metrale_device_calls_v1, alloc),
        "free", (Py_ssize_t)offsetof(metrale_device_calls_v1, free),
        "memset", (Py_ssize_t)offsetof(metrale_device_calls_v1, memset),
        "graph_launch", (Py_ssize_t)offsetof(metrale_device_calls_v1, graph_launch),
        "launch", (Py_ssize_t)offsetof(metrale_device_calls_v1, launch),
        "min_size", (Py_ssize_t)METRALE_DEVICE_CALLS_V1_MIN_SIZE,
        "capsule", METRALE_DEVICE_CALLS_CAPSULE,
        "done", METRALE_DEVICE_CALLS_DONE,
        "declined", METRALE_DEVICE_CALLS_DECLINED,
        "failed", METRALE_DEVICE_CALLS_FAILED,
        "version", METRALE_DEVICE_CALLS_VERSION);
}

/* holds(size, memset, graph_launch, launch): the header's helpers on a struct of size bytes with those set */
static PyObject *probe_holds(PyObject *module, PyObject *args) {
    metrale_device_calls_v1 calls;
    Py_ssize_t size;
    int memset_set, graph_launch_set, launch_set;
    if (!PyArg_ParseTuple(args, "nppp", &size, &memset_set, &graph_launch_set, &launch_set))
        return NULL;
    memset(&calls, 0, sizeof calls);
    calls.size = (size_t)size;
    calls.alloc = probe_alloc;
    calls.free = probe_free;
    if (memset_set)
        calls.memset = probe_memset;
    if (graph_launch_set)
        calls.graph_launch = probe_graph_launch;
    if (launch_set)
        calls.launch = probe_launch;
    return Py_BuildValue(
        "(iiii)", metrale_device_calls_v1_usable(&calls), metrale_device_calls_v1_has_memset(&calls),
        metrale_device_calls_v1_has_graph_launch(&calls), metrale_device_calls_v1_has_launch(&calls));
}

static PyMethodDef probe_methods[] = {
    {"capsule", probe_capsule, METH_VARARGS, NULL},
    {"counts", probe_counts, METH_O, NULL},
    {"layout", probe_layout, METH_NOARGS, NULL},
    {"holds", probe_holds, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef probe_module = {PyModuleDef_HEAD_INIT, MODULE_NAME, NULL, -1, probe_methods};

PyMODINIT_FUNC INIT_FUNCTION(void) { return PyModule_Create(&probe_module); }
"""

#: The languages the header is built in: C, and C++ (``extern "C"``), as the CUDA backend compiles it.
LANGUAGES = {"c": ("CC", ".c"), "c++": ("CXX", ".cpp")}


def _compiler(language: str) -> list[str]:
    """The compiler Python was built with for ``language``, as a command; a skip where it or Python.h is missing."""
    variable = LANGUAGES[language][0]
    command = shlex.split(sysconfig.get_config_var(variable) or "")
    if not command or shutil.which(command[0]) is None:
        pytest.skip(f"no {language} compiler here (sysconfig's {variable} is {' '.join(command) or 'unset'!r})")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip(f"no Python.h in {sysconfig.get_paths()['include']}: no C extension can be built here")
    return command


def _compile(language: str, source: str, out: Path, *flags: str) -> None:
    """Compile ``source`` with the header's folder and Python's on the include path, failing with the compiler's
    words."""
    src = out.with_suffix(LANGUAGES[language][1])
    src.write_text(source, encoding="utf-8")
    strict = ["-Werror=implicit-function-declaration", "-Werror=incompatible-pointer-types"] if language == "c" else []
    command = [*_compiler(language), *shlex.split(sysconfig.get_config_var("CCSHARED") or "-fPIC"), "-Wall", *strict,
               f"-I{sysconfig.get_paths()['include']}", f"-I{get_include()}", *flags, str(src), "-o", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}{done.stderr}"


@pytest.fixture(scope="module", params=list(LANGUAGES))
def probe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The probe module, built against the header in ``request.param`` and loaded."""
    language: str = request.param
    name = f"metrale_device_calls_probe_{language.replace('+', 'x')}"
    out = tmp_path_factory.mktemp(name) / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    _compile(language, SOURCE, out, "-shared", f'-DMODULE_NAME="{name}"', f"-DINIT_FUNCTION=PyInit_{name}")
    spec = importlib.util.spec_from_file_location(name, out)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_get_include_is_the_folder_of_the_header_the_package_ships() -> None:
    found = Path(get_include())
    assert found.is_absolute() and found == Path(metrale_core.plugin.__file__).resolve().parent / "include"
    assert HEADER.is_file() and "get_include" in metrale_core.plugin.__all__


def test_the_core_s_build_compiles_its_twins_against_the_same_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """setup.py finds the folder beside itself (it runs before metrale_core can be imported), and puts it on every
    twin's include path."""
    pytest.importorskip("setuptools", reason="setup.py imports setuptools, not installed here")
    import runpy

    monkeypatch.chdir(ROOT)  # (setup.py's twins are found from the folder a build runs in)
    setup = runpy.run_path(str(ROOT / "setup.py"), run_name="metrale_core_setup")
    assert setup["INCLUDE"] == ROOT / "metrale_core" / "include" and (setup["INCLUDE"] / "metrale").is_dir()
    if Path(metrale_core.plugin.__file__).resolve().is_relative_to(ROOT):  # (an editable install of this tree)
        assert setup["INCLUDE"] == Path(get_include())
    twins = setup["twins"]()
    assert twins and all(ext.include_dirs == [str(setup["INCLUDE"])] for ext in twins)


def test_the_header_defines_what_the_core_and_its_tests_read(probe: ModuleType) -> None:
    """One struct: the header's layout is the ctypes mirror's the tests call the struct through, and its capsule's
    name is ``DEVICE_CALLS``."""
    layout = probe.layout()
    pointer = ctypes.sizeof(ctypes.c_void_p)
    fields = ["size", "state", "alloc", "free", "memset", "graph_launch", "launch"]
    assert [layout[f] for f in fields] == [getattr(DeviceCallsTable, f).offset for f in fields]
    assert [layout[f] for f in fields] == [i * pointer for i in range(len(fields))]
    assert layout["sizeof"] == ctypes.sizeof(DeviceCallsTable) == len(fields) * pointer
    assert layout["min_size"] == layout["free"] + pointer
    assert (layout["capsule"], layout["version"]) == (DEVICE_CALLS, 1) and DEVICE_CALLS.endswith(".v1")
    assert (layout["done"], layout["declined"], layout["failed"]) == (0, 1, -1)


def test_the_header_s_helpers_read_a_shorter_struct_as_the_core_does(probe: ModuleType) -> None:
    pointer = ctypes.sizeof(ctypes.c_void_p)
    full = probe.layout()["sizeof"]
    assert probe.holds(full, True, True, True) == (1, 1, 1, 1)
    assert probe.holds(full, False, True, False) == (1, 0, 1, 0)  # (NULL: the method)
    assert probe.holds(4 * pointer, True, True, True) == (1, 0, 0, 0)  # ends after free: none of the optional ones
    assert probe.holds(6 * pointer, True, True, True) == (1, 1, 1, 0)
    assert probe.holds(4 * pointer - 1, True, True, True) == (0, 0, 0, 0)  # ends before free's end: refused


@pytest.fixture
def backend_with(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[GpuBackend, list[object]]]]:
    """Open a compiled fake backend whose device offers the probe's device calls: ``backend_with(probe, size=...)``
    gives the backend and the capsules handed out."""
    compiled_twin("lane")
    opened: list[GpuBackend] = []

    def open_with(module: ModuleType, **capsule_args: int) -> tuple[GpuBackend, list[object]]:
        capsules: list[object] = []

        def device_calls(device: RawDevice) -> object:
            capsules.append(module.capsule(device, *capsule_args.values()))
            return capsules[-1]

        from metrale_fake._device import FakeDevice

        monkeypatch.setattr(FakeDevice, "device_calls", device_calls)
        settings = SETTINGS.updated(pure=False, fake_memory_bytes=TEST_CAPACITY, redzone=0)
        opened.append(open_backend("fake", settings=settings))
        return opened[-1], capsules

    yield open_with
    for gpu in opened:
        gpu.close()


def test_the_core_calls_device_calls_built_against_the_header(
    probe: ModuleType, backend_with: Callable[..., tuple[GpuBackend, list[object]]]
) -> None:
    gpu, capsules = backend_with(probe)
    buf = gpu.alloc(MIB)
    done = [probe.counts(c) for c in capsules]
    assert (1, 0) in done and sum(a for a, _ in done) == 1  # the memory lane's capsule made the allocation
    gpu.free(buf)
    assert sum(f for _, f in (probe.counts(c) for c in capsules)) == 1
    stats = gpu.stats()
    assert (stats.alloc_count, stats.free_count, stats.current_bytes["device"], gpu.live_alloc_len()) == (1, 1, 0, 0)


@pytest.mark.parametrize("short", [0, 1])
def test_the_core_refuses_a_struct_shorter_than_the_header_s_least(
    probe: ModuleType, backend_with: Callable[..., tuple[GpuBackend, list[object]]], short: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A struct that ends at free is used (``METRALE_DEVICE_CALLS_V1_MIN_SIZE``); one byte shorter is refused,
    with a warning, and the methods run."""
    least = probe.layout()["min_size"]
    with caplog.at_level(logging.WARNING, logger="metrale"):
        gpu, capsules = backend_with(probe, size=least - short)
        gpu.free(gpu.alloc(MIB))
    made = sum(a + f for a, f in (probe.counts(c) for c in capsules))
    assert made == (0 if short else 2)
    refused = [r for r in caplog.records if re.search(rf"a struct of {least - 1} bytes", r.getMessage())]
    assert bool(refused) == bool(short)
    assert gpu.stats().alloc_count == 1 and gpu.live_alloc_len() == 0


#: docs/plugin-authors.md's sketch: the ```c block after this marker.
_SKETCH = re.compile(r"<!-- device-calls-example[^>]*-->\n```c\n(?P<code>.*?)^```$", re.S | re.M)


@pytest.mark.parametrize("language", list(LANGUAGES))
def test_the_plugin_page_s_sketch_compiles_against_the_header(language: str, tmp_path: Path) -> None:
    found = _SKETCH.search((ROOT / "docs" / "plugin-authors.md").read_text(encoding="utf-8"))
    assert found, "docs/plugin-authors.md has no <!-- device-calls-example --> C block"
    _compile(language, found["code"], tmp_path / "toy_calls.o", "-c")  # (its vendor_* functions: not linked)

