"""Reading PTX images: target architecture, kernels and their parameters; the arch preflight."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Final

from .._errors import ArchitectureError, InvalidArgumentError, error_for_code
from .._types import Param

__all__ = ["ArchitectureError", "Param", "PtxImage", "check_architecture", "parse_ptx"]

_TARGET_RE: Final = re.compile(r"^\s*\.target\s+sm_(\d+)([af]?)\b", re.MULTILINE)
_VERSION_RE: Final = re.compile(r"^\s*\.version\s+(\d+)\.(\d+)", re.MULTILINE)
_ENTRY_RE: Final = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)", re.DOTALL)
#: Instructions that need more than a PTX ``.target`` may say: (pattern, name, first sm, whether only an
#: architecture-specific target, ``sm_XXa`` or ``sm_XXf``, may use it). ``ptxas`` refuses them otherwise with a bare
#: ``CUDA_ERROR_INVALID_PTX`` at load; the preflight names them first.
_FEATURES: Final = (
    (re.compile(r"\bcp\.async\.bulk\b"), "cp.async.bulk (the TMA)", 90, False),
    (re.compile(r"\bmbarrier\.\w+\.expect_tx\b|\bmbarrier\.try_wait\b"), "mbarrier transaction counts", 90, False),
    (re.compile(r"\bwgmma\."), "wgmma", 90, True),
    (re.compile(r"\bsetmaxnreg\."), "setmaxnreg", 90, True),
    (re.compile(r"\btcgen05\."), "tcgen05", 100, True),
)

_PARAM_RE: Final = re.compile(
    r"\.param\s+(?:\.align\s+(\d+)\s+)?\.([busf])(8|16|32|64)\s+(?:\.ptr\s+(?:\.\w+\s+)*)?"
    r"([A-Za-z_$][\w$]*)(?:\[(\d+)\])?"
)


@dataclasses.dataclass(frozen=True, slots=True)
class PtxImage:
    """What metrale reads from a PTX image."""

    sm: int
    suffix: str
    version: tuple[int, int] | None
    entries: Mapping[str, tuple[Param, ...]]
    #: The instructions it uses that need a newer or an architecture-specific target (``"wgmma"``...).
    features: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        return f"sm_{self.sm}{self.suffix}"

    def requirement(self) -> str:
        """What the image needs, in words: ``"sm_80 or newer"``, ``"exactly sm_90a"``..."""
        if self.suffix == "a":
            return f"exactly {self.target}"
        if self.suffix == "f":
            return f"the sm_{self.sm // 10}x family at sm_{self.sm} or later"
        return f"{self.target} or newer"

    def feature_problems(self) -> list[str]:
        """What its own target cannot assemble, in words: an instruction used under a target too old for
        it, or an architecture-specific instruction (``wgmma``) under a portable target (``sm_90``, not
        ``sm_90a``). Such an image loads on no device."""
        problems = []
        for _, name, sm, specific in _FEATURES:
            if name not in self.features:
                continue
            if self.sm < sm:
                problems.append(f"it uses {name}, which needs sm_{sm} or newer, under .target {self.target}")
            elif specific and not self.suffix:
                problems.append(f"it uses {name}, which only an architecture-specific target assembles "
                                f"(.target sm_{self.sm}a), under .target {self.target}")
        return problems

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Whether a device of compute ``capability`` can load this image.

        Plain PTX is forward compatible (the driver compiles it for newer
        devices); ``sm_XXa`` images run only on exactly that architecture and
        ``sm_XXf`` ones on that family (same major, minor at least as high).
        """
        device = capability[0] * 10 + capability[1]
        if self.suffix == "a":
            return device == self.sm
        if self.suffix == "f":
            return capability[0] == self.sm // 10 and capability[1] >= self.sm % 10
        return device >= self.sm


def _text(image: bytes | bytearray | str) -> str:
    return image.decode("utf-8", errors="replace") if isinstance(image, bytes | bytearray) else str(image)


def parse_ptx(module: str, image: bytes | bytearray | str) -> PtxImage:
    """Parse one PTX image; an image without a ``.target`` raises ``InvalidArgumentError``."""
    text = _text(image)
    target = _TARGET_RE.search(text)
    if target is None:
        raise InvalidArgumentError(
            f"module {module!r} is not a PTX image with a `.target sm_XX` line; pass the text "
            f"`nvcc -ptx` writes"
        )
    version = _VERSION_RE.search(text)
    entries: dict[str, tuple[Param, ...]] = {}
    for entry in _ENTRY_RE.finditer(text):
        params = tuple(
            Param(
                name=m.group(4), kind=m.group(2), size=int(m.group(3)) // 8, count=int(m.group(5) or 1),
                align=int(m.group(1) or 0),
            )
            for m in _PARAM_RE.finditer(entry.group(2))
        )
        entries[entry.group(1)] = params
    return PtxImage(
        sm=int(target.group(1)),
        suffix=target.group(2),
        version=(int(version.group(1)), int(version.group(2))) if version else None,
        entries=entries,
        features=tuple(name for pattern, name, _, _ in _FEATURES if pattern.search(text)),
    )


def check_architecture(
    images: Mapping[str, PtxImage], capability: tuple[int, int], device: str, *, what: str = "load_modules"
) -> None:
    """Refuse, in one error listing every one, the images ``device`` cannot run; ``what`` names the call."""
    broken = {name: img.feature_problems() for name, img in images.items()}
    broken = {name: problems for name, problems in broken.items() if problems}
    if broken:
        err = error_for_code("CUDA_ERROR_INVALID_PTX", what)
        listing = "; ".join(f"{name}: {', '.join(problems)}" for name, problems in broken.items())
        raise ArchitectureError(
            f"{what}: no device can load {listing}; rebuild with the target the instructions need "
            f"(`nvcc -ptx -gencode=arch=compute_90a,code=sm_90a` for sm_90a)",
            code=err.code,
            name=err.name,
        )
    refused = [(name, img) for name, img in images.items() if not img.runs_on(capability)]
    if not refused:
        return
    err = error_for_code("CUDA_ERROR_NO_BINARY_FOR_GPU", what)
    listing = ", ".join(f"{name} (targets {img.target}: needs {img.requirement()})" for name, img in refused)
    raise ArchitectureError(
        f"{what}: {device} has compute capability {capability[0]}.{capability[1]} (sm_"
        f"{capability[0]}{capability[1]}) and cannot run {listing}; rebuild those modules with "
        f"`nvcc -ptx -arch=compute_{capability[0]}{capability[1]}` or older",
        code=err.code,
        name=err.name,
    )
