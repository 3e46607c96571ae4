"""A recording double of the `tensorrt` Python module, as TensorRT 8.5 or 10.3 spells it.

It proves CALL ORDER AND NAMES ONLY, never behaviour: no kernel runs, no ONNX is really parsed by
TensorRT. What it enforces:
  * only names the real bindings of that version have: each fake offers a subset of the names in the
    strings of `tensorrt_bindings-8.6.1` (8.x) or `tensorrt_cu12_bindings-10.3.0` (10.x) (checked in
    tests/test_trt_api.py), so `build_engine`, `set_binding_shape`, `execute_async_v2`,
    `get_binding_index` or `max_workspace_size` raise AttributeError on both, and the 10.x-only
    `set_device_memory`, `device_memory_size_v2`, `ExecutionContextAllocationStrategy` on 8.5;
    `builder_optimization_level` exists from 8.6 only, so not on the 8.5 fake;
  * explicit batch: 8.5's `create_network` refuses flags without EXPLICIT_BATCH;
  * profiles: `set_shape` needs min <= opt <= max; the build fails when a dynamic network input has
    no range in some profile; a context refuses input shapes outside its profile;
  * a run: `execute_async_v3` needs every I/O tensor's shape and address set on that context.
The network comes from the real ONNX file (inputs with -1 for symbolic dims, one layer per node), and
a "run" fills each output at its address with a step number, so the runner's cache writes are visible.
"""
from __future__ import annotations

import ctypes
import json
import types
from dataclasses import dataclass, field

import numpy as np
import onnx


@dataclass
class Recorder:
    calls: list[tuple[str, tuple]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)

    def __call__(self, name: str, *args: object) -> None:
        self.calls.append((name, args))
        self.names.add(name.split(".")[-1])

    def called(self, name: str) -> list[tuple]:
        return [a for n, a in self.calls if n == name]


class _Recorded:
    """Records every public attribute read (what the code under test touches)."""

    _rec: Recorder

    def __getattribute__(self, name: str) -> object:
        if not name.startswith("_"):
            object.__getattribute__(self, "_rec").names.add(name)
        return object.__getattribute__(self, name)


def make_fake(version: str) -> types.ModuleType:
    major, minor = (int(v) for v in version.split(".")[:2])
    ten = major >= 10
    rec = Recorder()

    class FakeModule(types.ModuleType):
        def __getattribute__(self, name: str) -> object:
            if not name.startswith("_") and name not in ("recorder",):
                rec.names.add(name)
            return super().__getattribute__(name)

    trt = FakeModule("tensorrt")
    trt.__version__ = version
    trt.recorder = rec  # type: ignore[attr-defined]
    trt.float32, trt.float16, trt.int32 = "float32", "float16", "int32"  # type: ignore[attr-defined]

    sev = types.SimpleNamespace(INTERNAL_ERROR=0, ERROR=1, WARNING=2, INFO=3, VERBOSE=4)

    class ILogger:
        Severity = sev
        WARNING = 2

        def __init__(self) -> None:
            pass

    class Logger(ILogger):
        def __init__(self, min_severity: int = 2) -> None:
            super().__init__()

    trt.ILogger, trt.Logger = ILogger, Logger  # type: ignore[attr-defined]
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(EXPLICIT_BATCH=0)  # type: ignore[attr-defined]
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")  # type: ignore[attr-defined]
    trt.BuilderFlag = types.SimpleNamespace(FP16="FP16", INT8="INT8",  # type: ignore[attr-defined]
                                            OBEY_PRECISION_CONSTRAINTS="OBEY_PRECISION_CONSTRAINTS")
    if ten:
        trt.ExecutionContextAllocationStrategy = types.SimpleNamespace(STATIC=0, USER_MANAGED=2)  # type: ignore

    class Tensor(_Recorded):
        def __init__(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
            self._rec, self.name, self.shape, self.dtype = rec, name, shape, dtype

    class Layer(_Recorded):
        def __init__(self, node: onnx.NodeProto) -> None:
            self._rec, self.name = rec, node.name
            ints = node.op_type in ("Shape", "Equal", "Less", "Range", "ConstantOfShape") or \
                (node.op_type == "Cast" and any(a.name == "to" and a.i != 1 for a in node.attribute))
            self._outs = [Tensor(o, (), "int32" if ints else "float32") for o in node.output]
            self.num_outputs = len(node.output)
            self._precision = None

        def get_output(self, j: int) -> Tensor:
            return self._outs[j]

        @property
        def precision(self) -> object:
            return self._precision

        @precision.setter
        def precision(self, value: object) -> None:
            rec("ILayer.precision", self.name, value)
            self._precision = value

        def set_output_type(self, j: int, dtype: object) -> None:
            rec("ILayer.set_output_type", self.name, j, dtype)

    class Network(_Recorded):
        def __init__(self) -> None:
            self._rec, self._inputs, self._layers, self._outputs = rec, [], [], []

        @property
        def num_inputs(self) -> int:
            return len(self._inputs)

        def get_input(self, i: int) -> Tensor:
            return self._inputs[i]

        @property
        def num_layers(self) -> int:
            return len(self._layers)

        def get_layer(self, i: int) -> Layer:
            return self._layers[i]

    class OnnxParser(_Recorded):
        def __init__(self, network: Network, logger: ILogger) -> None:
            self._rec, self._network = rec, network
            rec("OnnxParser")

        def parse_from_file(self, path: str) -> bool:
            rec("OnnxParser.parse_from_file", path)
            m = onnx.load(path, load_external_data=False)

            def io(v: onnx.ValueInfoProto) -> Tensor:
                dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim)
                sym = [d.dim_param for d in v.type.tensor_type.shape.dim]
                t = Tensor(v.name, dims, onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name)
                t._sym = sym  # type: ignore[attr-defined]
                return t

            inits = {t.name for t in m.graph.initializer}
            self._network._inputs = [io(v) for v in m.graph.input if v.name not in inits]
            self._network._outputs = [io(v) for v in m.graph.output]
            self._network._layers = [Layer(n) for n in m.graph.node]
            return True

        @property
        def num_errors(self) -> int:
            return 0

        def get_error(self, i: int) -> object:
            raise IndexError(i)

    class Profile(_Recorded):
        def __init__(self) -> None:
            self._rec, self._shapes = rec, {}

        def set_shape(self, name: str, mn: tuple, opt: tuple, mx: tuple) -> None:
            rec("IOptimizationProfile.set_shape", name, tuple(mn), tuple(opt), tuple(mx))
            if not (len(mn) == len(opt) == len(mx)) or not all(a <= b <= c for a, b, c in zip(mn, opt, mx)):
                raise ValueError(f"set_shape({name}): min <= opt <= max violated: {mn} {opt} {mx}")
            self._shapes[name] = (tuple(mn), tuple(opt), tuple(mx))

    class TimingCache(_Recorded):
        def __init__(self, data: bytes) -> None:
            self._rec, self._data = rec, data

        def serialize(self) -> bytes:
            return self._data + b"+"

    config_attrs = {"builder_optimization_level"} if (major, minor) >= (8, 6) else set()

    class Config(_Recorded):
        def __init__(self) -> None:
            object.__setattr__(self, "_rec", rec)
            object.__setattr__(self, "_profiles", [])
            object.__setattr__(self, "_flags", [])
            object.__setattr__(self, "_cache", None)

        def __setattr__(self, name: str, value: object) -> None:
            if name not in config_attrs and not name.startswith("_"):
                raise AttributeError(f"IBuilderConfig has no attribute {name!r} in TensorRT {version}")
            rec(f"IBuilderConfig.{name}", value)
            object.__setattr__(self, name, value)

        def set_memory_pool_limit(self, pool: str, size: int) -> None:
            rec("IBuilderConfig.set_memory_pool_limit", pool, size)

        def set_flag(self, flag: str) -> None:
            rec("IBuilderConfig.set_flag", flag)
            self._flags.append(flag)

        def add_optimization_profile(self, p: Profile) -> int:
            rec("IBuilderConfig.add_optimization_profile")
            self._profiles.append(p)
            return len(self._profiles) - 1

        def create_timing_cache(self, data: bytes) -> TimingCache:
            rec("IBuilderConfig.create_timing_cache", data)
            return TimingCache(bytes(data))

        def set_timing_cache(self, cache: TimingCache, ignore_mismatch: bool) -> bool:
            rec("IBuilderConfig.set_timing_cache", ignore_mismatch)
            object.__setattr__(self, "_cache", cache)
            return True

        def get_timing_cache(self) -> TimingCache:
            return self._cache

    class Builder(_Recorded):
        def __init__(self, logger: ILogger) -> None:
            self._rec = rec
            rec("Builder")

        def create_network(self, flags: int = 0) -> Network:
            rec("Builder.create_network", flags)
            if not ten and not flags & (1 << trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH):
                raise ValueError("TensorRT 8.5: implicit batch network (pass EXPLICIT_BATCH)")
            return Network()

        def create_builder_config(self) -> Config:
            return Config()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: Config) -> bytes | None:
            rec("Builder.build_serialized_network")
            for t in network._inputs:
                if any(d < 0 for d in t.shape) and any(t.name not in p._shapes for p in config._profiles):
                    return None  # TensorRT: a dynamic input without a range in some profile
            plan = {"inputs": [[t.name, t._sym, t.dtype, list(t.shape)] for t in network._inputs],
                    "outputs": [[t.name, t._sym, t.dtype, list(t.shape)] for t in network._outputs],
                    "profiles": [{k: list(map(list, v)) for k, v in p._shapes.items()} for p in config._profiles]}
            return json.dumps(plan).encode()

    class Context(_Recorded):
        def __init__(self, engine: "Engine") -> None:
            self._rec, self._engine, self._profile, self._shapes, self._addr = rec, engine, None, {}, {}

        def set_optimization_profile_async(self, k: int, stream: int) -> bool:
            rec("IExecutionContext.set_optimization_profile_async", k, stream)
            self._profile = k
            return True

        def set_input_shape(self, name: str, shape: tuple) -> bool:
            rec("IExecutionContext.set_input_shape", name, tuple(shape), self._profile)
            mn, _, mx = self._engine._plan["profiles"][self._profile][name]
            if len(shape) != len(mn) or not all(a <= s <= b for a, s, b in zip(mn, shape, mx)):
                return False
            self._shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name: str, ptr: int) -> bool:
            rec("IExecutionContext.set_tensor_address", name)
            self._addr[name] = ptr
            return True

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            sym: dict[str, int] = {}
            for n, s, _, _ in self._engine._plan["inputs"]:
                for d, v in zip(s, self._shapes.get(n, ())):
                    if d:
                        sym[d] = v
            out = next(o for o in self._engine._plan["outputs"] if o[0] == name)
            return tuple(sym[d] if d else v for d, v in zip(out[1], out[3]))

        def execute_async_v3(self, stream: int) -> bool:
            rec("IExecutionContext.execute_async_v3", stream, self._profile)
            names = [i[0] for i in self._engine._plan["inputs"]]
            if set(names) - set(self._shapes) or set(names + [o[0] for o in self._engine._plan["outputs"]]) - set(self._addr):
                raise RuntimeError("execute_async_v3 before every tensor had a shape and an address")
            self._engine._steps += 1
            for name in (o[0] for o in self._engine._plan["outputs"]):
                n = int(np.prod(self.get_tensor_shape(name)))
                if n:
                    np.frombuffer((ctypes.c_float * n).from_address(self._addr[name]), np.float32)[:] = self._engine._steps
            return True

        if not ten:
            device_memory = property(None, lambda self, ptr: rec("IExecutionContext.device_memory", ptr))
        else:
            def set_device_memory(self, ptr: int, size: int) -> None:
                rec("IExecutionContext.set_device_memory", ptr, size)

    class Engine(_Recorded):
        def __init__(self, plan: dict) -> None:
            self._rec, self._plan, self._steps = rec, plan, 0
            self.num_optimization_profiles = len(plan["profiles"])
            self._io = [i[0] for i in plan["inputs"]] + [o[0] for o in plan["outputs"]]
            self.num_io_tensors = len(self._io)
            if ten:
                self.device_memory_size_v2 = 4096
            else:
                self.device_memory_size = 4096

        def get_tensor_name(self, i: int) -> str:
            return self._io[i]

        if ten:
            def create_execution_context(self, strategy: int = 0) -> Context:
                rec("ICudaEngine.create_execution_context", strategy)
                return Context(self)
        else:
            def create_execution_context_without_device_memory(self) -> Context:
                rec("ICudaEngine.create_execution_context_without_device_memory")
                return Context(self)

    class Runtime(_Recorded):
        def __init__(self, logger: ILogger) -> None:
            self._rec = rec

        def deserialize_cuda_engine(self, data: bytes) -> Engine | None:
            rec("Runtime.deserialize_cuda_engine")
            try:
                return Engine(json.loads(data))
            except ValueError:
                return None

    trt.Builder, trt.OnnxParser, trt.Runtime = Builder, OnnxParser, Runtime  # type: ignore[attr-defined]
    return trt
