"""The edge server: Triton Inference Server (through PyTriton, which bundles `tritonserver` and its
Python backend) hosting the deep layers as the model `deep_slice`, state in `DeepSliceSessions`.

Run as `python -m partition.offload.server ...` under an interpreter whose numpy is < 2 (Triton's
Python-backend stub in PyTriton 0.7 returns empty tensors with numpy 2) and with that interpreter's
own libpython first on LD_LIBRARY_PATH (`partition.offload.launch` does both). Triton's dynamic
batcher hands several requests to one call; their decode steps run as one batch. Auth: Triton's own
`--grpc-restricted-protocol inference:authorization=Bearer <token>`; TLS: Triton's gRPC SSL options.
Metrics: Triton's Prometheus endpoint on the metrics port.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np

from partition.offload import protocol as P
from partition.offload.sessions import DeepRequest, DeepSliceSessions, OffloadRequestError

if TYPE_CHECKING:
    from pytriton.model_config import Tensor


class TritonRequest(Protocol):
    """What the PyTriton callable reads of a request: its named input arrays."""

    data: dict[str, np.ndarray]


InferFunc = Callable[[list[TritonRequest]], list[dict[str, np.ndarray]]]


def parse_request(data: dict[str, np.ndarray]) -> DeepRequest:
    """One request's input tensors (each with a leading batch dimension of 1) as a DeepRequest."""
    def one(name: str) -> np.ndarray:
        return np.asarray(data[name])[0]
    if data.get(P.HIDDEN_I8) is not None:
        q, scale = one(P.HIDDEN_I8), one(P.HIDDEN_SCALE)
        if q.ndim != 2 or scale.reshape(-1).shape[0] != q.shape[0]:
            raise ValueError(f"int8 hidden states {tuple(q.shape)} need one scale per row, got {tuple(scale.shape)}")
        hidden = P.dequantize_rows(q, scale)
    else:
        hidden = one(P.HIDDEN).astype(np.float16)
    return DeepRequest(seq_id=int(one(P.SEQ_ID).reshape(-1)[0]), split=int(one(P.SPLIT).reshape(-1)[0]),
                       hidden=hidden, positions=one(P.POSITIONS).astype(np.int32),
                       start=bool(one(P.SEQ_START).reshape(-1)[0]), end=bool(one(P.SEQ_END).reshape(-1)[0]),
                       want_logits=bool(one(P.WANT_LOGITS).reshape(-1)[0]))


def batch_outputs(result: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v[None] for k, v in result.items()}


def garble(result: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fault injection for tests (`--fault garbage`): a reply that breaks the protocol's promises."""
    return {**result, P.NEXT_TOKEN: np.asarray([-3], dtype=np.int32),
            P.TOPK_LOGPROBS: np.full_like(result[P.TOPK_LOGPROBS], np.nan)}


def make_infer(sessions: DeepSliceSessions, fault: str = "none") -> InferFunc:
    """The PyTriton inference callable: a list of requests in, a list of output dicts out. A refused
    request fails the whole call (PyTriton has no per-request errors), with every reason listed."""
    def infer(requests: list[TritonRequest]) -> list[dict[str, np.ndarray]]:
        parsed: list[DeepRequest | OffloadRequestError] = []
        for r in requests:
            try:
                parsed.append(parse_request(r.data))
            except (KeyError, ValueError, IndexError) as exc:
                parsed.append(OffloadRequestError(f"malformed request: {exc}"))
        good = [p for p in parsed if isinstance(p, DeepRequest)]
        results = iter(sessions.step_many(good))
        out: list[dict[str, np.ndarray] | OffloadRequestError] = [
            next(results) if isinstance(p, DeepRequest) else p for p in parsed]
        errors = [str(o) for o in out if isinstance(o, OffloadRequestError)]
        if errors:
            raise OffloadRequestError("; ".join(errors))
        fix = garble if fault == "garbage" else (lambda o: o)
        return [batch_outputs(fix(o)) for o in out if isinstance(o, dict)]
    return infer


def tensors(hidden: int) -> tuple[list[Tensor], list[Tensor]]:
    from pytriton.model_config import Tensor
    inputs = [Tensor(name=P.HIDDEN, dtype=np.float16, shape=(-1, hidden), optional=True),
              Tensor(name=P.HIDDEN_I8, dtype=np.int8, shape=(-1, hidden), optional=True),
              Tensor(name=P.HIDDEN_SCALE, dtype=np.float16, shape=(-1,), optional=True),
              Tensor(name=P.POSITIONS, dtype=np.int32, shape=(-1,)),
              Tensor(name=P.SPLIT, dtype=np.int32, shape=(1,)),
              Tensor(name=P.SEQ_ID, dtype=np.uint64, shape=(1,)),
              Tensor(name=P.SEQ_START, dtype=np.bool_, shape=(1,)),
              Tensor(name=P.SEQ_END, dtype=np.bool_, shape=(1,)),
              Tensor(name=P.WANT_LOGITS, dtype=np.bool_, shape=(1,))]
    outputs = [Tensor(name=P.NEXT_TOKEN, dtype=np.int32, shape=(1,)),
               Tensor(name=P.TOPK_IDS, dtype=np.int32, shape=(-1,)),
               Tensor(name=P.TOPK_LOGPROBS, dtype=np.float32, shape=(-1,)),
               Tensor(name=P.LOGITS, dtype=np.float32, shape=(-1,))]
    return inputs, outputs


def _require_bearer_token(token: str) -> None:
    """Make Triton itself refuse inference calls without the bearer token (Triton's restricted-protocol
    option: over gRPC it reads the metadata `triton-grpc-protocol-authorization: Bearer <token>`,
    which EdgeLink sends beside the plain `authorization`). PyTriton 0.7 sets that option for its own endpoints (header
    triton-access-token), overwriting any from TritonConfig, and splits the command line on spaces;
    so its argument list is rebuilt with each value whole and the inference restriction appended
    (Triton takes the option once per protocol group)."""
    from pytriton.server.triton_server_config import TritonServerConfig

    restriction = f"inference:authorization=Bearer {token}"

    def to_args_list(self: TritonServerConfig) -> list[str]:
        out: list[str] = []
        for key, val in self.server_args().items():
            for v in (val if isinstance(val, (list, tuple)) else [val]) if val is not None else []:
                out += [f"--{key}", f"{v}"]
        return out + ["--grpc-restricted-protocol", restriction, "--http-restricted-api", restriction]

    TritonServerConfig.to_args_list = to_args_list  # type: ignore[method-assign]


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt   # leave `with Triton(...)` normally: Triton stops, shared memory is freed


def serve(args: argparse.Namespace) -> None:
    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import Triton, TritonConfig

    from partition.checkpoint import load_model

    model = load_model(Path(args.model))
    n = model.config.n_layers
    first = args.first_layer
    sessions = DeepSliceSessions(model, first, cap=args.cap, max_seq=args.max_seq,
                                 idle_timeout_s=args.idle_timeout)
    kw: dict[str, object] = {"grpc_address": args.host, "grpc_port": args.grpc_port,
                             "http_address": args.host, "http_port": args.http_port,
                             "metrics_port": args.metrics_port, "exit_timeout_secs": 5}
    if args.token:
        _require_bearer_token(args.token)
    if args.tls_cert:   # Triton's --grpc-use-ssl[-mutual], --grpc-server-cert/-key, --grpc-root-cert
        kw.update(grpc_use_ssl=True, grpc_server_cert=Path(args.tls_cert), grpc_server_key=Path(args.tls_key))
        if args.tls_ca:  # mutual TLS: clients must present a certificate this CA signed
            kw.update(grpc_use_ssl_mutual=True, grpc_root_cert=Path(args.tls_ca))
    stop = threading.Event()

    def sweeper() -> None:
        while not stop.wait(max(1.0, args.idle_timeout / 4)):
            sessions.sweep()

    threading.Thread(target=sweeper, daemon=True).start()
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    inputs, outputs = tensors(model.config.hidden_size)
    with Triton(config=TritonConfig(**kw)) as triton:  # type: ignore[arg-type]
        triton.bind(model_name=P.MODEL_NAME, infer_func=make_infer(sessions, args.fault), inputs=inputs, outputs=outputs,
                    config=ModelConfig(max_batch_size=args.cap, batcher=DynamicBatcher(max_queue_delay_microseconds=500)),
                    strict=False)
        print(f"edge: serving layers {first}:{n} of {args.model} as model '{P.MODEL_NAME}' on gRPC "
              f"{args.host}:{args.grpc_port}, HTTP {args.http_port}, metrics {args.metrics_port} "
              f"(cap {args.cap} sequences, idle timeout {args.idle_timeout:g} s)", file=sys.stderr, flush=True)
        try:
            triton.serve()
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m partition.offload.server", description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--first-layer", type=int, required=True)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--grpc-port", type=int, required=True)
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--metrics-port", type=int, required=True)
    ap.add_argument("--cap", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--idle-timeout", type=float, default=60.0)
    ap.add_argument("--token", default="")
    ap.add_argument("--tls-cert", default="")
    ap.add_argument("--tls-key", default="")
    ap.add_argument("--tls-ca", default="", help="CA of the client certificates (mutual TLS)")
    ap.add_argument("--fault", choices=("none", "garbage"), default="none", help="tests only: inject a fault")
    return ap.parse_args(argv)


if __name__ == "__main__":
    serve(parse_args())
