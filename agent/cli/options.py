"""The command-line options several commands share, declared once. A group is a frozen dataclass whose
fields are options (flags, help, value type): `ModelOptions` (serve, generate), `ExitOptions` (serve,
generate), `EdgeOptions` (serve, generate), `BoardOptions` (serve, smoke). A command takes a group as
one parameter whose default is `options(Group, **defaults)`, and `@shared_options` turns that parameter
into the group's typer options (in field order, each with the command's default or None) and hands the
command the filled-in dataclass.

To add a shared option, add a field to its group with `opt(...)`: every command that takes the group
gets the flag; each command then reads it (`model_opts.new_field`) and, for serve, passes it on to
`ServiceConfig.replace`. A command that wants a default other than None passes it to `options(...)`.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, TypeVar

import typer

from agent.config import DEFAULT_CONFIG_PATH

F = TypeVar("F", bound=Callable[..., Any])

MODEL_HELP = ("Checkpoint folder (config.json, *.safetensors, tokenizer.json), a .gguf file, or an installed model's "
              "alias (smollm2-135m-instruct); default: the shipped model.")
DTYPE_HELP = ("Float parts' dtype: fp32, fp16 or bf16 (torch backend; the ONNX backends are fp32). Default fp32 on the "
              "CPU (measured: bf16 changes SmolLM2's top-1 token at ~3-4 % of positions, fp16 is no faster there), "
              "fp16 with --device cuda (1.13x fp32's decode on an H200).")


def opt(*decls: str, help: str, envvar: str | None = None) -> Any:
    """A group's field: the option's flags and help. Its default is each command's (None unless given)."""
    return field(default=None, metadata={"decls": decls, "help": help, "envvar": envvar})


@dataclass(frozen=True)
class ModelOptions:
    """Which model, on which runner, with which KV-cache."""
    model: Optional[Path] = opt("--model", help=MODEL_HELP)
    backend: Optional[str] = opt("--backend", help="Runner: torch (PyTorch) or ort (ONNX Runtime; exports the "
                                 "slices on first use and caches them).")
    kv_cache: Optional[str] = opt("--kv-cache", help="KV-cache storage: fp16 (the model's dtype, unquantised) or "
                                  "int8 (torch: group-wise INT8 with FP16 scales; ort: INT8 Q/DQ slices with static "
                                  "scales calibrated at build time; trt: not built yet).")
    kv_blocks: Optional[int] = opt("--kv-blocks", help="Paged KV-cache of N blocks of 16 tokens per layer instead "
                                   "of per-row caches (torch backend, fp16 cache).")
    dtype: Optional[str] = opt("--dtype", help=DTYPE_HELP)


@dataclass(frozen=True)
class ExitOptions:
    """Early exits and self-speculation through the calibrated exit heads (orin-agent train-exits)."""
    speculate: Optional[str] = opt("--speculate", help="Self-speculative decoding: K draft tokens per round from "
                                   "an exit head, or 'auto' (lossless: the same output).")
    max_disagreement: Optional[float] = opt("--max-disagreement", help="Exit early where the calibrated heads keep "
                                            "disagreement with the full model below this rate (orin-agent calibrate).")


@dataclass(frozen=True)
class EdgeOptions:
    """The deep layers on an edge server (orin-agent edge) over gRPC."""
    edge: Optional[str] = opt("--edge", help="HOST:PORT of an edge server (orin-agent edge) that runs the deep "
                              "layers.")
    device_layers: Optional[str] = opt("--device-layers", help="With --edge: layers run here, or 'auto' (the "
                                       "planner on the link measured to the edge).")
    edge_token: Optional[str] = opt("--edge-token", envvar="ORIN_AGENT_EDGE_TOKEN", help="The edge's bearer token.")
    link_dtype: Optional[str] = opt("--link-dtype", help="Hidden states on the link: fp16 or int8 (per-position "
                                    "int8 with FP16 scales: about half the bytes).")
    edge_tls_ca: Optional[str] = opt("--edge-tls-ca", help="PEM CA of the edge's certificate: gRPC over TLS.")
    edge_tls_cert: Optional[str] = opt("--edge-tls-cert", help="PEM client certificate (mutual TLS).")
    edge_tls_key: Optional[str] = opt("--edge-tls-key", help="PEM client key (mutual TLS).")


@dataclass(frozen=True)
class BoardOptions:
    """The service's config file and the board it runs on."""
    config: Optional[Path] = opt("--config", help=f"Service config file (default {DEFAULT_CONFIG_PATH} if "
                                 "present, else built-in defaults).")
    root: Optional[str] = opt("--root", help="Root of the board's file tree: '/' on an Orin, a twin folder "
                              "elsewhere.")
    run_dir: Optional[str] = opt("--run-dir", help="Where the restore journal lives.")


@dataclass(frozen=True)
class _Group:
    cls: type
    defaults: Mapping[str, Any]
    notes: Mapping[str, str]


def options(cls: type, notes: Mapping[str, str] | None = None, **defaults: Any) -> Any:
    """A command parameter that stands for the group `cls`: `defaults` by field name (None for the rest),
    `notes` a sentence added to a field's help in this command, e.g. what its default means here."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = (set(defaults) | set(notes or {})) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no option {', '.join(sorted(unknown))}")
    return _Group(cls, dict(defaults), dict(notes or {}))


def _required(t: Any) -> Any:
    """Optional[X] -> X (the option's type when its default is a value)."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if typing.get_origin(t) in (typing.Union, types.UnionType) and len(args) == 1 else t


def _group_params(g: _Group) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(g.cls)
    out = []
    for f in dataclasses.fields(g.cls):
        default = g.defaults.get(f.name)
        help_ = " ".join((f.metadata["help"], g.notes[f.name])) if f.name in g.notes else f.metadata["help"]
        info = typer.Option(default, *f.metadata["decls"], help=help_, envvar=f.metadata["envvar"])
        out.append(inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=info,
                                     annotation=hints[f.name] if default is None else _required(hints[f.name])))
    return out


def shared_options(fn: F) -> F:
    """Expand every parameter of `fn` whose default is `options(Group, ...)` into the group's options;
    the call gathers them back into one `Group` instance under the parameter's name."""
    sig = inspect.signature(fn, eval_str=True)
    hints = typing.get_type_hints(fn)
    groups: dict[str, _Group] = {}
    params: list[inspect.Parameter] = []
    for p in sig.parameters.values():
        if isinstance(p.default, _Group):
            groups[p.name] = p.default
            params.extend(_group_params(p.default))
        else:
            params.append(p.replace(annotation=hints.get(p.name, p.annotation)))
    seen: set[str] = set()
    for p in params:
        if p.name in seen:
            raise TypeError(f"{fn.__name__}: option {p.name!r} is declared twice")
        seen.add(p.name)

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        for name, g in groups.items():
            kwargs[name] = g.cls(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(g.cls)})
        return fn(**kwargs)

    command.__signature__ = sig.replace(parameters=params, return_annotation=hints.get("return", None))  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command  # type: ignore[return-value]
