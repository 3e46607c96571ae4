"""Where the project meets the `tensorrt` module: loading it, its version, and the few calls whose
spelling differs between TensorRT 8.5/8.6 (JetPack 5) and 10.3 (JetPack 6). Everything else in
partition.trt calls only what both versions share (TENSORRT.md, "The API both versions share").

Version differences handled here (names checked against the strings of the real Python bindings,
`tensorrt_bindings-8.6.1` and `tensorrt_cu12_bindings-10.3.0`; tests/test_trt_api.py):
  * explicit batch: `NetworkDefinitionCreationFlag.EXPLICIT_BATCH` is required on 8.x and deprecated
    and ignored on 10.x (the only mode there), so the flag is passed on 8.x only;
  * activation memory shared by several contexts: 8.x creates contexts with
    `create_execution_context_without_device_memory()` and assigns `context.device_memory`, sized by
    `engine.device_memory_size`; 10.1+ uses `create_execution_context(ExecutionContextAllocationStrategy
    .USER_MANAGED)` and `context.set_device_memory(ptr, engine.device_memory_size_v2)`;
  * `IBuilderConfig.builder_optimization_level` exists from 8.6.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from types import ModuleType


class TrtUnavailable(RuntimeError):
    """TensorRT's Python bindings are not importable here."""


@dataclass(frozen=True, order=True)
class TrtVersion:
    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> "TrtVersion":
        """'8.5.2.2', '10.3.0' or '10.3' -> TrtVersion."""
        m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
        if not m:
            raise ValueError(f"not a TensorRT version: {text!r}")
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))

    @property
    def explicit_batch_flag(self) -> bool:
        return self.major < 10

    @property
    def user_managed_memory(self) -> bool:
        # set_device_memory and device_memory_size_v2 arrived in 10.1; 10.0 keeps the 8.x spelling
        return (self.major, self.minor) >= (10, 1)

    @property
    def has_optimization_level(self) -> bool:
        return (self.major, self.minor) >= (8, 6)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def load_tensorrt() -> ModuleType:
    """The `tensorrt` module, or TrtUnavailable saying where it comes from on a board."""
    try:
        return importlib.import_module("tensorrt")
    except ImportError as exc:
        raise TrtUnavailable("TensorRT's Python bindings are not installed here (on a Jetson they come with JetPack: "
                             f"apt install python3-libnvinfer; {exc})") from None


def version_of(trt: ModuleType) -> TrtVersion:
    return TrtVersion.parse(str(trt.__version__))


def network_flags(trt: ModuleType, version: TrtVersion) -> int:
    """The `create_network` flags: explicit batch, spelled as each version needs."""
    if version.explicit_batch_flag:
        return 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    return 0


def context_without_memory(trt: ModuleType, engine: object, version: TrtVersion) -> tuple[object, int]:
    """An execution context that uses activation memory we assign, and the bytes it needs."""
    if version.user_managed_memory:
        ctx = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)  # type: ignore[attr-defined]
        return ctx, int(engine.device_memory_size_v2)  # type: ignore[attr-defined]
    return engine.create_execution_context_without_device_memory(), int(engine.device_memory_size)  # type: ignore[attr-defined]


def assign_memory(context: object, ptr: int, size: int, version: TrtVersion) -> None:
    """Point a context created by `context_without_memory` at `size` bytes of device memory at `ptr`."""
    if version.user_managed_memory:
        context.set_device_memory(ptr, size)  # type: ignore[attr-defined]
    else:
        context.device_memory = ptr  # type: ignore[attr-defined]
