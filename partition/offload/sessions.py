"""The edge server's state: per-sequence KV-caches of the deep layers, keyed by sequence id.

A session is created by a request with the start flag, lives in one row (slot) of a TorchRunner
whose cache has `cap` rows, and is freed by the end flag, by `idle_timeout_s` without a request, or
by eviction of the least recently used idle session when a new one needs room. Decode requests
(T = 1) of several sequences on the same split run as ONE batched step over their slots: continuous
batching across sequences, whatever step each one is at. Runs under any host (PyTriton binding,
Triton Python-backend model.py, or a test) with no Triton import.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from partition.model import Transformer
from partition.offload.protocol import AT_CAPACITY, SESSION_LOST, reply_arrays
from partition.slices import SliceSpec
from partition.runners.torch_runner import TorchRunner


class OffloadRequestError(ValueError):
    """A request the server refuses; the message says why (and carries a protocol marker)."""


@dataclass(frozen=True)
class DeepRequest:
    seq_id: int
    split: int
    hidden: np.ndarray       # (T, D) float16
    positions: np.ndarray    # (T,) int32, consecutive
    start: bool
    end: bool
    want_logits: bool


@dataclass
class _Session:
    split: int
    slot: int
    length: int
    last_used: float = field(default=0.0)


class DeepSliceSessions:
    """Layers [split, L) for any split >= first_layer, for up to `cap` live sequences."""

    def __init__(self, model: Transformer, first_layer: int, cap: int = 8, max_seq: int = 1024,
                 idle_timeout_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self.n_layers = model, model.config.n_layers
        if not 1 <= first_layer < self.n_layers:
            raise ValueError(f"the edge must serve layers A:{self.n_layers} with 1 <= A < {self.n_layers}, "
                             f"got A = {first_layer}")
        if cap < 1:
            raise ValueError(f"the session cap must be at least 1, got {cap}")
        self.first_layer, self.cap, self.max_seq = first_layer, cap, max_seq
        self.idle_timeout_s, self.clock = idle_timeout_s, clock
        self.hidden_size = model.config.hidden_size
        self._runners: dict[int, TorchRunner] = {}
        self._sessions: dict[int, _Session] = {}
        self._lock = threading.Lock()
        self.evicted = 0

    def live(self) -> int:
        return len(self._sessions)

    def _runner(self, split: int) -> TorchRunner:
        if split not in self._runners:
            spec = SliceSpec(split, self.n_layers, self.n_layers)
            self._runners[split] = TorchRunner(self.model, spec, self.max_seq, self.cap)
        return self._runners[split]

    def sweep(self) -> int:
        """Free every session idle for longer than the timeout; returns how many."""
        with self._lock:
            return self._sweep(self.clock())

    def _sweep(self, now: float) -> int:
        stale = [k for k, s in self._sessions.items() if now - s.last_used > self.idle_timeout_s]
        for k in stale:
            del self._sessions[k]
        self.evicted += len(stale)
        return len(stale)

    def _open(self, req: DeepRequest, now: float) -> _Session:
        self._sessions.pop(req.seq_id, None)
        self._sweep(now)
        used = {s.slot for s in self._sessions.values()}
        if len(used) >= self.cap:
            raise OffloadRequestError(f"{AT_CAPACITY}: the edge holds its cap of {self.cap} live sequences, "
                                      f"each used within the last {self.idle_timeout_s:g} s; retry later")
        slot = min(set(range(self.cap)) - used)
        sess = _Session(req.split, slot, 0, now)
        self._sessions[req.seq_id] = sess
        return sess

    def _check(self, req: DeepRequest, now: float) -> _Session:
        if not self.first_layer <= req.split < self.n_layers:
            raise OffloadRequestError(f"split {req.split} is outside what this edge serves "
                                      f"({self.first_layer}..{self.n_layers - 1})")
        t = req.positions.shape[0]
        if req.hidden.ndim != 2 or req.hidden.shape != (t, self.hidden_size) or t == 0:
            raise OffloadRequestError(f"hidden states of shape {tuple(req.hidden.shape)} do not match "
                                      f"{t} positions x hidden size {self.hidden_size}")
        if not np.array_equal(req.positions, np.arange(req.positions[0], req.positions[0] + t)):
            raise OffloadRequestError("positions must be consecutive")
        if int(req.positions[-1]) >= self.max_seq:
            raise OffloadRequestError(f"position {int(req.positions[-1])} is past the edge's context of "
                                      f"{self.max_seq} tokens")
        if req.start:
            if int(req.positions[0]) != 0:
                raise OffloadRequestError("a request with the start flag must begin at position 0")
            return self._open(req, now)
        sess = self._sessions.get(req.seq_id)
        if sess is None:
            raise OffloadRequestError(f"{SESSION_LOST}: no state for sequence {req.seq_id} (server restarted, "
                                      "idle timeout or evicted); resend from position 0 with the start flag")
        if sess.split != req.split:
            raise OffloadRequestError(f"sequence {req.seq_id} started at split {sess.split}, not {req.split}")
        if int(req.positions[0]) > sess.length:
            raise OffloadRequestError(f"{SESSION_LOST}: sequence {req.seq_id} holds {sess.length} positions; "
                                      f"a request at {int(req.positions[0])} leaves a gap")
        return sess

    def step_many(self, reqs: Sequence[DeepRequest]) -> list[dict[str, np.ndarray] | OffloadRequestError]:
        """Serve a batch of requests; each gets its output arrays or the error that refused it.
        Single-position requests on one split are run together as one batched step."""
        with self._lock:
            now = self.clock()
            out: list[dict[str, np.ndarray] | OffloadRequestError] = [OffloadRequestError("not run")] * len(reqs)
            ready: list[tuple[int, DeepRequest, _Session]] = []
            seen: set[int] = set()
            for i, r in enumerate(reqs):
                try:
                    if r.seq_id in seen:
                        raise OffloadRequestError(f"sequence {r.seq_id} sent twice in one batch")
                    seen.add(r.seq_id)
                    ready.append((i, r, self._check(r, now)))
                except OffloadRequestError as exc:
                    out[i] = exc
            decode: dict[int, list[tuple[int, DeepRequest, _Session]]] = {}
            for item in ready:
                if item[1].positions.shape[0] == 1:
                    decode.setdefault(item[1].split, []).append(item)
                else:
                    self._run([item], out)
            for group in decode.values():
                self._run(group, out)
            for i, r, sess in ready:
                sess.last_used = now
                sess.length = max(sess.length, int(r.positions[-1]) + 1)
                if r.end:
                    self._sessions.pop(r.seq_id, None)
            return out

    def _run(self, group: list[tuple[int, DeepRequest, _Session]],
             out: list[dict[str, np.ndarray] | OffloadRequestError]) -> None:
        runner = self._runner(group[0][1].split)
        x = torch.from_numpy(np.stack([r.hidden for _, r, _ in group]).astype(np.float32))
        pos = np.stack([r.positions for _, r, _ in group]).astype(np.int32)
        logits = runner.run(x, pos, [s.slot for _, _, s in group]).float().numpy()
        for row, (i, r, _) in enumerate(group):
            out[i] = reply_arrays(logits[row], r.want_logits)
