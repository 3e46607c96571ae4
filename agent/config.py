"""The service's configuration: /etc/orin-agent/agent.toml (path overridable), validated on start into
a frozen `ServiceConfig`; command-line flags override the file. Every error names the file and key.

    [model]   dir, backend ("auto" | "torch" | "ort" | "trt"; auto: partition/runners/backend_choice.py),
              slices ("0:4,4:8"), max_seq, device, kv_cache ("fp16" | "int8"),
              exits (load the exit heads: requests may ask for early exits / speculation), max_disagreement
              and speculate (K or "auto"): the default of every request that asks for neither,
              kv_blocks (paged cache: blocks of 16 tokens), dtype ("fp32" | "fp16" | "bf16": the float parts, torch;
              "auto", the default: fp16 for the torch runner on CUDA without exits, else fp32)
    [server]  host, port, token, token_file, allowed_hosts, max_body_bytes, max_in_flight, keep_alive_s,
              header_timeout_s, body_timeout_s
    [board]   root ("" = auto: "/" on an Orin, else a fresh twin), run_dir, profile, power_control (the
              board lock is not a setting: always <root>/run/lock/orin-agent/board.lock, power.hw.rootlock)
    [limits]  max_batch, max_queue, max_prompt_tokens, max_output_tokens, default_max_tokens,
              shutdown_grace_s
    [log]     level
    [smoke]   min_decode_tok_s, max_ttft_s (what `orin-agent smoke` asks of its short generation)
    [edge]    url (HOST:PORT of `orin-agent edge`; "" = no offload), device_layers (N or "auto"), token,
              fallback (hold the deep layers here too), link_dtype ("fp16" | "int8"), tls_ca, tls_cert,
              tls_key, board (this device's board for the "auto" planner), replan (with "auto" and fallback:
              re-plan on the live link), replan_every (exchanges), replan_interval_s, replan_hysteresis
              (a fraction), probe_interval_s (the bounded probe rate while device only)
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from agent.engine.types import MAX_SPECULATE
from partition.config import DTYPE_NAMES
from partition.paths import DEFAULT_MODEL_DIR

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6's Ubuntu 22.04): the same parser, from PyPI
    import tomli as tomllib

DEFAULT_CONFIG_PATH = Path("/etc/orin-agent/agent.toml")
LOG_LEVELS = ("debug", "info", "warning", "error")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


class ConfigError(ValueError):
    """A bad configuration; the message names the file and the key."""


@dataclass(frozen=True)
class ServiceConfig:
    model_dir: Path = DEFAULT_MODEL_DIR
    backend: str = "auto"  # the fastest measured runner for the model (partition/runners/backend_choice.py)
    slices: str | None = None
    max_seq: int | None = None  # None: the model's context, at most partition.config.MAX_SEQ_CAP
    device: str = "cpu"
    kv_cache: str = "fp16"  # "int8": INT8 KV-cache (torch: group-wise; ort: Q/DQ slices)
    kv_blocks: int | None = None  # a paged KV-cache of this many blocks of 16 tokens (torch, fp16 cache); None: rows
    dtype: str = "auto"  # the float parts' dtype (partition.checkpoint.DTYPES); auto: partition.config.default_dtype
    threads: int = 0  # CPU threads for the model's kernels; 0 = every core but one
    exits: bool = False  # load the exit heads beside the model (implied by the next two)
    max_disagreement: float | None = None  # default early-exit target of every request (None: full depth)
    speculate: str | None = None  # default self-speculation: draft tokens "K" or "auto" (None: off)
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted; () = the loopback names on a loopback bind
    max_body_bytes: int = 1 << 20
    max_in_flight: int = 0  # HTTP requests answered at once (more get 503); 0 = 2 * max_queue + 32, at least 64
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    header_timeout_s: float = 10.0  # a connection whose request headers are not in by then is closed
    body_timeout_s: float = 30.0  # a request whose body is not in this long after its headers gets 408
    root: str | None = None  # None: "/" on an Orin, else a fresh twin
    run_dir: str = "/run/orin-agent"
    profile: str = "balanced"
    power_control: bool = True  # run power.runtime.controller (phase-aware DVFS + thermal) when it can open the board
    power_cap_w: float | None = None  # a power budget over the profile's [budget] watts (power.policy.budget)
    max_batch: int = 8
    max_queue: int = 64
    max_prompt_tokens: int | None = None  # None: the context less one
    max_output_tokens: int = 1024
    default_max_tokens: int = 128
    shutdown_grace_s: float = 10.0
    log_level: str = "info"
    # `orin-agent smoke`'s floor for its short generation: loose enough that any working install
    # clears it (the shipped model decodes at ~80-210 tok/s on 2 x86 cores, docs/BENCHMARKS.md), so a
    # failure means something is broken, not slow; tighten them in agent.toml for a real model.
    smoke_min_decode_tok_s: float = 5.0
    smoke_max_ttft_s: float = 5.0
    edge: str | None = None  # HOST:PORT of an edge server running the deep layers (partition.offload)
    device_layers: str = "4"  # layers run here with an edge: N or "auto" (the planner on the measured link)
    edge_token: str | None = None
    edge_fallback: bool = True  # hold the deep layers here too: a failed edge degrades to local decoding
    link_dtype: str = "fp16"
    edge_tls_ca: str | None = None
    edge_tls_cert: str | None = None
    edge_tls_key: str | None = None
    edge_board: str = "orin-nano-8gb"
    edge_replan: bool = True  # with device_layers "auto" and fallback: offload or device only, re-planned live
    edge_replan_every: int = 32  # exchanges between re-plans ...
    edge_replan_interval_s: float = 5.0  # ... or seconds, whichever first
    edge_replan_hysteresis: float = 0.2  # re-plan at once on this relative move; switch for this relative gain
    edge_probe_interval_s: float = 10.0  # while device only: at most one probe of the edge per this many seconds
    source: str = "defaults"

    def replace(self, **overrides: Any) -> "ServiceConfig":
        """Apply CLI overrides (None = not given) and validate again."""
        given = {k: v for k, v in overrides.items() if v is not None}
        cfg = dataclasses.replace(self, **given)
        cfg.validate()
        return cfg

    def with_model_folder(self) -> "ServiceConfig":
        """The config with model_dir a model folder: a .gguf file or a model alias in [model] dir (or --model)
        becomes the folder partition/gguf/folder.py makes for it; a checkpoint folder stays as it is."""
        from partition.gguf.folder import is_gguf_ref, resolve_model

        return dataclasses.replace(self, model_dir=resolve_model(self.model_dir)) if is_gguf_ref(self.model_dir) else self

    @property
    def host_names(self) -> tuple[str, ...]:
        """The Host header names the guard accepts (without port); () = any (a non-loopback bind with a token)."""
        if self.allowed_hosts:
            return tuple(h.lower() for h in self.allowed_hosts)
        if is_loopback(self.host):
            return tuple(dict.fromkeys(("localhost", "127.0.0.1", "::1", self.host.lower())))
        return ()

    @property
    def exits_enabled(self) -> bool:
        """The exit heads are loaded (and requests may carry an `orin_agent` exit field)."""
        return self.exits or self.max_disagreement is not None or self.speculate not in (None, "0")

    @property
    def request_limit(self) -> int:
        """HTTP requests answered at once (the guard answers 503 past it)."""
        return self.max_in_flight or max(64, self.max_queue * 2 + 32)

    def validate(self) -> None:
        src = self.source

        def bad(key: str, what: str, got: object) -> ConfigError:
            return ConfigError(f"{src}: {key}: {what}, got {got!r}")

        if self.backend not in ("auto", "torch", "ort", "trt"):
            raise bad("model.backend", "must be 'auto', 'torch', 'ort' or 'trt'", self.backend)
        torch_ok = self.backend in ("auto", "torch")  # auto picks torch for the torch-only features below
        if self.kv_cache not in ("fp16", "int8"):
            raise bad("model.kv_cache", "must be 'fp16' or 'int8'", self.kv_cache)
        if self.kv_cache == "int8" and self.backend == "trt":
            raise bad("model.kv_cache", "'int8' needs model.backend = 'torch' or 'ort' (trt: not built yet)",
                      self.kv_cache)
        if self.dtype not in (*DTYPE_NAMES, "auto"):
            raise bad("model.dtype", f"must be one of {', '.join(DTYPE_NAMES)} or auto", self.dtype)
        if self.dtype not in ("fp32", "auto") and (not torch_ok or self.exits_enabled):
            raise bad("model.dtype", "fp16 / bf16 need model.backend = 'torch' and no exits (the ONNX graphs and the "
                      "exit heads are fp32)", (self.dtype, self.backend))
        if self.kv_blocks is not None and (self.kv_blocks < 1 or not torch_ok or self.kv_cache != "fp16"):
            raise bad("model.kv_blocks", "must be >= 1, with model.backend = 'torch' and kv_cache = 'fp16'",
                      self.kv_blocks)
        if self.threads < 0:
            raise bad("model.threads", "must be >= 0 (0 = every core but one)", self.threads)
        if self.max_seq is not None and self.max_seq < 2:
            raise bad("model.max_seq", "must be >= 2", self.max_seq)
        if self.max_disagreement is not None and not 0 <= self.max_disagreement < 1:
            raise bad("model.max_disagreement", "must be a rate in [0, 1)", self.max_disagreement)
        if self.speculate is not None and self.speculate != "auto" and \
                not (self.speculate.isdigit() and int(self.speculate) <= MAX_SPECULATE):
            raise bad("model.speculate", f"must be 'auto' or draft tokens 0..{MAX_SPECULATE}", self.speculate)
        if self.max_disagreement is not None and self.speculate not in (None, "0"):
            raise bad("model.speculate", "early exits (max_disagreement) and speculation are two modes: "
                      "give one", self.speculate)
        if self.exits_enabled and (not torch_ok or self.kv_cache != "fp16" or self.kv_blocks is not None):
            raise bad("model.exits", "early exits and speculation need model.backend = 'torch', "
                      "model.kv_cache = 'fp16' and no model.kv_blocks", (self.backend, self.kv_cache, self.kv_blocks))
        if not 0 <= self.port <= 65535:
            raise bad("server.port", "must be in 0..65535 (0 = any free port)", self.port)
        if not self.host:
            raise bad("server.host", "must be an address (127.0.0.1 keeps the service local)", self.host)
        if not is_loopback(self.host) and not self.token:
            raise bad("server.host", "a non-loopback address needs a bearer token (server.token_file); "
                      "without one any host on the network could drive the API", self.host)
        if any(not h or "/" in h for h in self.allowed_hosts):
            raise bad("server.allowed_hosts", "must be host names (no scheme, no path)", list(self.allowed_hosts))
        if self.power_cap_w is not None and not 0.5 <= self.power_cap_w <= 500:
            raise bad("board.power_cap_w", "must be watts from 0.5 to 500", self.power_cap_w)
        if self.max_body_bytes < 1024:
            raise bad("server.max_body_bytes", "must be >= 1024", self.max_body_bytes)
        if self.max_in_flight < 0:
            raise bad("server.max_in_flight", "must be >= 0 (0 = from limits.max_queue)", self.max_in_flight)
        for key, t in (("server.keep_alive_s", self.keep_alive_s), ("server.header_timeout_s", self.header_timeout_s),
                       ("server.body_timeout_s", self.body_timeout_s)):
            if not 0 < t <= 3600:
                raise bad(key, "must be in (0, 3600] seconds", t)
        for key, v, lo in (("limits.max_batch", self.max_batch, 1), ("limits.max_queue", self.max_queue, 0),
                           ("limits.max_output_tokens", self.max_output_tokens, 1),
                           ("limits.default_max_tokens", self.default_max_tokens, 1)):
            if v < lo:
                raise bad(key, f"must be an integer >= {lo}", v)
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise bad("limits.max_prompt_tokens", "must be >= 1", self.max_prompt_tokens)
        if self.default_max_tokens > self.max_output_tokens:
            raise bad("limits.default_max_tokens", f"must be <= limits.max_output_tokens ({self.max_output_tokens})",
                      self.default_max_tokens)
        if self.shutdown_grace_s < 0:
            raise bad("limits.shutdown_grace_s", "must be >= 0", self.shutdown_grace_s)
        if self.smoke_min_decode_tok_s < 0 or self.smoke_max_ttft_s <= 0:
            raise bad("smoke.min_decode_tok_s / smoke.max_ttft_s", "must be >= 0 / > 0",
                      (self.smoke_min_decode_tok_s, self.smoke_max_ttft_s))
        if self.edge is not None:
            host, _, port = self.edge.rpartition(":")
            if not host or not port.isdigit():
                raise bad("edge.url", "must be HOST:PORT (the edge server's gRPC endpoint)", self.edge)
            if not torch_ok or self.slices or self.kv_cache != "fp16":
                raise bad("edge.url", "offload runs layers 0:N with model.backend = 'torch', no model.slices "
                          "and the fp16 KV-cache", self.edge)
            if self.device_layers != "auto" and not self.device_layers.isdigit():
                raise bad("edge.device_layers", "must be a number of layers or 'auto'", self.device_layers)
            if self.link_dtype not in ("fp16", "int8"):
                raise bad("edge.link_dtype", "must be 'fp16' or 'int8'", self.link_dtype)
            if self.edge_replan_every < 1 or self.edge_replan_interval_s <= 0 or self.edge_probe_interval_s <= 0:
                raise bad("edge.replan_every / replan_interval_s / probe_interval_s", "must be >= 1 / > 0 / > 0",
                          (self.edge_replan_every, self.edge_replan_interval_s, self.edge_probe_interval_s))
            if not 0 <= self.edge_replan_hysteresis < 1:
                raise bad("edge.replan_hysteresis", "must be a fraction in [0, 1)", self.edge_replan_hysteresis)
            if self.speculate not in (None, "0") or (self.kv_blocks is not None):
                raise bad("edge.url", "with an edge server, speculation (it verifies drafts with the deep "
                          "layers' logits, which the edge does not return) and model.kv_blocks are off",
                          (self.speculate, self.kv_blocks))
        if self.log_level not in LOG_LEVELS:
            raise bad("log.level", f"must be one of {', '.join(LOG_LEVELS)}", self.log_level)


# (section, key) -> (field, type(s) accepted, converter)
_SCHEMA: dict[tuple[str, str], tuple[str, tuple[type, ...]]] = {
    ("model", "dir"): ("model_dir", (str,)),
    ("model", "backend"): ("backend", (str,)),
    ("model", "slices"): ("slices", (str,)),
    ("model", "max_seq"): ("max_seq", (int,)),
    ("model", "device"): ("device", (str,)),
    ("model", "threads"): ("threads", (int,)),
    ("model", "kv_cache"): ("kv_cache", (str,)),
    ("model", "dtype"): ("dtype", (str,)),
    ("model", "exits"): ("exits", (bool,)),
    ("model", "max_disagreement"): ("max_disagreement", (int, float)),
    ("model", "speculate"): ("speculate", (int, str)),
    ("model", "kv_blocks"): ("kv_blocks", (int,)),
    ("server", "host"): ("host", (str,)),
    ("server", "port"): ("port", (int,)),
    ("server", "token"): ("token", (str,)),
    ("server", "token_file"): ("token", (str,)),
    ("server", "allowed_hosts"): ("allowed_hosts", (list,)),
    ("server", "max_body_bytes"): ("max_body_bytes", (int,)),
    ("server", "max_in_flight"): ("max_in_flight", (int,)),
    ("server", "keep_alive_s"): ("keep_alive_s", (int, float)),
    ("server", "header_timeout_s"): ("header_timeout_s", (int, float)),
    ("server", "body_timeout_s"): ("body_timeout_s", (int, float)),
    ("board", "root"): ("root", (str,)),
    ("board", "run_dir"): ("run_dir", (str,)),
    ("board", "profile"): ("profile", (str,)),
    ("board", "power_cap_w"): ("power_cap_w", (int, float)),
    ("board", "power_control"): ("power_control", (bool,)),
    ("limits", "max_batch"): ("max_batch", (int,)),
    ("limits", "max_queue"): ("max_queue", (int,)),
    ("limits", "max_prompt_tokens"): ("max_prompt_tokens", (int,)),
    ("limits", "max_output_tokens"): ("max_output_tokens", (int,)),
    ("limits", "default_max_tokens"): ("default_max_tokens", (int,)),
    ("limits", "shutdown_grace_s"): ("shutdown_grace_s", (int, float)),
    ("log", "level"): ("log_level", (str,)),
    ("smoke", "min_decode_tok_s"): ("smoke_min_decode_tok_s", (int, float)),
    ("smoke", "max_ttft_s"): ("smoke_max_ttft_s", (int, float)),
    ("edge", "url"): ("edge", (str,)),
    ("edge", "device_layers"): ("device_layers", (str, int)),
    ("edge", "token"): ("edge_token", (str,)),
    ("edge", "fallback"): ("edge_fallback", (bool,)),
    ("edge", "link_dtype"): ("link_dtype", (str,)),
    ("edge", "tls_ca"): ("edge_tls_ca", (str,)),
    ("edge", "tls_cert"): ("edge_tls_cert", (str,)),
    ("edge", "tls_key"): ("edge_tls_key", (str,)),
    ("edge", "board"): ("edge_board", (str,)),
    ("edge", "replan"): ("edge_replan", (bool,)),
    ("edge", "replan_every"): ("edge_replan_every", (int,)),
    ("edge", "replan_interval_s"): ("edge_replan_interval_s", (int, float)),
    ("edge", "replan_hysteresis"): ("edge_replan_hysteresis", (int, float)),
    ("edge", "probe_interval_s"): ("edge_probe_interval_s", (int, float)),
}

# Keys that were settings once, each with why it is gone.
_REMOVED = {("board", "lock_dir"): "the board lock is always <root>/run/lock/orin-agent/board.lock (/run/lock/"
            "orin-agent on a board), so that no two commands can hold different locks on one board"}


def read_token_file(path: str, where: str) -> str:
    """The token in ``path``; refused when other users may read or write the file (as OpenSSH refuses
    a private key with any group or other permission bit), naming the chmod that fixes it."""
    try:
        mode = os.stat(path).st_mode & 0o777
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read the token file {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise ConfigError(f"{where}: the token file {path} is open to other users (mode {mode:04o}); run "
                          f"`chmod 600 {path}`")
    if not token:
        raise ConfigError(f"{where}: the token file {path} is empty")
    return token


def config_from_mapping(doc: Mapping[str, Any], source: str) -> ServiceConfig:
    values: dict[str, Any] = {}
    sections = {s for s, _ in _SCHEMA}
    for section, table in doc.items():
        if section not in sections:
            raise ConfigError(f"{source}: unknown section [{section}]; known: {', '.join(sorted(sections))}")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {section} must be a table ([{section}])")
        for key, value in table.items():
            spec = _SCHEMA.get((section, key))
            if (section, key) in _REMOVED:
                raise ConfigError(f"{source}: {section}.{key} is no longer a setting: {_REMOVED[(section, key)]}; "
                                  "delete the line")
            if spec is None:
                known = sorted(k for s, k in _SCHEMA if s == section)
                raise ConfigError(f"{source}: unknown key {section}.{key}; known keys: {', '.join(known)}")
            field_name, types = spec
            if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
                names = " or ".join(t.__name__ for t in types)
                raise ConfigError(f"{source}: {section}.{key}: must be {names}, got {value!r}")
            if key == "token_file":
                if "token" in table and table["token"]:
                    raise ConfigError(f"{source}: server.token and server.token_file: give one, not both")
                if value:
                    values["token"] = read_token_file(value, f"{source}: server.token_file")
                continue
            if field_name in ("slices", "root", "token", "edge", "edge_token", "edge_tls_ca",
                              "edge_tls_cert", "edge_tls_key") and value == "":
                continue  # "" = unset
            if field_name == "device_layers":
                value = str(value)
            if field_name == "allowed_hosts":
                if not all(isinstance(h, str) for h in value):
                    raise ConfigError(f"{source}: {section}.{key}: must be a list of strings, got {value!r}")
                value = tuple(value)
            if field_name == "speculate":
                value = str(value)
            values[field_name] = Path(value) if field_name == "model_dir" else value
    cfg = ServiceConfig(**values, source=source)
    cfg.validate()
    return cfg


def load_config(path: str | os.PathLike[str] | None) -> ServiceConfig:
    """The file at `path`; with None, /etc/orin-agent/agent.toml if it exists, else the defaults."""
    if path is None:
        if not DEFAULT_CONFIG_PATH.is_file():
            return ServiceConfig()
        path = DEFAULT_CONFIG_PATH
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file: {exc.strerror}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    return config_from_mapping(doc, str(p))
