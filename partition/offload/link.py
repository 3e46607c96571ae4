"""The device side of offload: `EdgeLink`, a SliceRunner for layers [N, L) that runs them on the edge
server over KServe v2 gRPC (tritonclient), so a Chain [local 0:N] + [EdgeLink N:L] is the model.

Per cache row (slot) the link keeps the sequence id and the FP16 hidden states it has sent: that
history is what rebuilds the edge's state after a restart, an idle timeout or an eviction (one
request from position 0 with the start flag), and what fills a local deep slice when the link falls
back. `send` takes any number of consecutive positions at once: a prefill, a rebuild, or the backlog
of hidden states of tokens that exited early on the device (they cross in the next round trip).
The rows of a batched step cross at once (one thread each). On the wire the hidden states are FP16,
or per-position int8 with FP16 scales (`link_dtype`); gRPC runs over TLS when a CA is given.
With a `policy` (partition.offload.replan) and a local deep slice, the link re-plans on its own
measurements: new sequences run device only while the planner (or a fault) says so, sequences in
flight move to the local slice (filled exactly from their history), and a background probe at a
bounded rate brings new sequences back to the edge when the link recovers.

Faults: every attempt has a gRPC deadline, retries are bounded, and the whole call has a deadline;
when it passes, the call falls back to the local deep slice (if the device holds one) or raises
EdgeError with the reason. Nothing waits without a deadline.
"""
from __future__ import annotations

import random
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from partition.offload import protocol as P
from partition.runners.base import SliceRunner
from partition.slices import SliceSpec

if TYPE_CHECKING:
    from partition.offload.replan import SplitPolicy


def short_error(msg: str, limit: int = 300) -> str:
    """A server error in one line: the status and the last 'SomethingError: ...' line of a traceback."""
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    if len(lines) > 1:
        reasons = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception): ", ln)]
        lines = [lines[0].split(" ")[0], reasons[-1]] if reasons else lines[:1]
    out = " ".join(lines)
    return out if len(out) <= limit else out[:limit] + "..."


def auth_headers(token: str) -> dict[str, str]:
    """gRPC metadata carrying the bearer token: `authorization` for whatever fronts the edge (a proxy,
    a gateway), and Triton's own prefixed copy, which its restricted-protocol check reads."""
    if not token:
        return {}
    value = f"Bearer {token}"
    return {"authorization": value, "triton-grpc-protocol-authorization": value}


class EdgeError(OSError):
    """The edge could not answer within the deadline and there is no local fallback."""


class _Transient(Exception):
    """An attempt that may succeed if repeated (timeout, unavailable, a malformed reply)."""


class _Fatal(Exception):
    """An attempt that will not succeed if repeated (refused, unauthorised, at capacity)."""


class _Lost(Exception):
    """The edge holds no state for the sequence: resend the history."""


@dataclass(frozen=True)
class LinkShape:
    """An injected link for tests and benchmarks: each round trip costs rtt_ms plus the payload at mbps."""

    rtt_ms: float
    mbps: float

    def delay_s(self, nbytes: int) -> float:
        return self.rtt_ms / 1e3 + nbytes * 8 / (self.mbps * 1e6)


@dataclass(frozen=True)
class LinkStats:
    round_trips: int = 0
    positions_sent: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    retries: int = 0
    rebuilds: int = 0
    fallbacks: int = 0
    rtt_ms: float = 0.0          # moving average of single-position round trips
    wait_s: float = 0.0          # wall time spent in successful round trips (link + edge)
    mbps: float = 0.0            # effective bandwidth from multi-position exchanges (0: none yet)
    last_error: str = ""


@dataclass
class _Slot:
    seq_id: int = 0
    history: list[np.ndarray] = field(default_factory=list)   # one (D,) float16 row per position
    local: bool = False                                        # fell back: the deep slice runs here


@dataclass(frozen=True)
class LinkOptions:
    token: str = ""
    timeout_s: float = 5.0         # one attempt's gRPC deadline
    deadline_s: float = 15.0       # a whole call (attempts, backoff, rebuild)
    retries: int = 2
    want_logits: bool = True       # False: top-k only (enough for greedy decoding)
    ssl: bool = False              # gRPC over TLS (set by any of the three files below)
    root_certificates: str | None = None   # PEM file of the CA that signed the edge's certificate
    private_key: str | None = None         # PEM files of this device's own key and certificate, for an
    certificate_chain: str | None = None   # edge that asks for client certificates (mutual TLS)
    link_dtype: str = "fp16"       # hidden states on the wire: fp16, or int8 rows with FP16 scales
    sequence_params: bool = False  # standalone Triton with a sequence batcher: ids travel as parameters


def link_options(token: str = "", want_logits: bool = True, link_dtype: str = "fp16", tls_ca: str = "",
                 tls_cert: str = "", tls_key: str = "") -> LinkOptions:
    """LinkOptions from CLI/config values, checked: TLS is on when a CA is given (the edge's
    certificate is verified against it); a client certificate and key go together (mutual TLS)."""
    from pathlib import Path

    if link_dtype not in P.LINK_DTYPES:
        raise ValueError(f"--link-dtype must be one of {', '.join(P.LINK_DTYPES)}, got {link_dtype!r}")
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("the edge client certificate and its key go together (--edge-tls-cert, --edge-tls-key)")
    if tls_cert and not tls_ca:
        raise ValueError("a client certificate (mutual TLS) needs the CA of the edge's certificate too (--edge-tls-ca)")
    for f in (tls_ca, tls_cert, tls_key):
        if f and not Path(f).is_file():
            raise ValueError(f"{f}: no such PEM file")
    return LinkOptions(token=token, want_logits=want_logits, link_dtype=link_dtype, ssl=bool(tls_ca),
                       root_certificates=tls_ca or None, private_key=tls_key or None,
                       certificate_chain=tls_cert or None)


class EdgeLink(SliceRunner):
    array_kind = "numpy"

    def __init__(self, url: str, spec: SliceSpec, vocab: int, hidden: int, max_seq: int, max_batch: int = 1,
                 options: LinkOptions = LinkOptions(), fallback: SliceRunner | None = None,
                 shape: LinkShape | None = None, log: Callable[[str], None] | None = None) -> None:
        import tritonclient.grpc as grpcclient

        if spec.is_first or not spec.is_last:
            raise ValueError(f"the edge runs the deep layers N:L with N >= 1, not {spec}")
        self.url, self.spec, self.vocab, self.hidden = url, spec, vocab, hidden
        self.max_seq, self.max_batch, self.opts = max_seq, max_batch, options
        self.fallback, self.shape = fallback, shape
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self._grpc = grpcclient
        if options.link_dtype not in P.LINK_DTYPES:
            raise ValueError(f"link dtype must be one of {', '.join(P.LINK_DTYPES)}, got {options.link_dtype!r}")
        self.client = grpcclient.InferenceServerClient(
            url, ssl=options.ssl or bool(options.root_certificates or options.certificate_chain),
            root_certificates=options.root_certificates, private_key=options.private_key,
            certificate_chain=options.certificate_chain)
        self._base_id = random.getrandbits(54) << 8        # one sequence id per slot, reused:
        self._slots = [_Slot() for _ in range(max_batch)]   # a start flag replaces the old state
        self._stats = LinkStats()
        self._lock = threading.Lock()        # the stats and the local fallback, shared by the row threads
        self._pool: ThreadPoolExecutor | None = None
        self.policy: SplitPolicy | None = None   # re-planning (partition.offload.replan); needs `fallback`
        self._probe: threading.Thread | None = None

    # --- the runner contract ------------------------------------------------------------------------

    def run(self, x: Any, positions: np.ndarray, slots: Sequence[int] | None = None) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int32)
        rows = self.check_room(positions, slots)
        x = np.asarray(x)
        if len(rows) == 1:
            return self.send(rows[0], x[0], positions[0])[None]
        # the rows of a batched step cross at once (the gRPC client is thread-safe for infer), so a
        # batch pays about one round trip, and the edge's batcher runs their decode steps together
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_batch, thread_name_prefix="edge-link")
        futures = [self._pool.submit(self.send, r, x[i], positions[i]) for i, r in enumerate(rows)]
        return np.stack([f.result() for f in futures])

    def send(self, slot: int, hidden: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """T consecutive positions of the sequence in `slot` (hidden (T, D) entering layer N): their
        deep KV is written on the edge; returns the logits (V,) after the last one."""
        st = self._slots[slot]
        p0, t = int(positions[0]), int(positions.shape[0])
        device_only = self._device_only()
        if p0 == 0:   # a new sequence takes the path the policy chose; it keeps it unless the link degrades
            self._slots[slot] = st = _Slot(seq_id=self._base_id + slot + 1, local=device_only)
        if p0 > len(st.history):
            raise ValueError(f"slot {slot} holds {len(st.history)} positions; position {p0} leaves a gap")
        del st.history[p0:]
        h16 = np.asarray(hidden, dtype=np.float16).reshape(t, self.hidden)
        st.history.extend(h16)
        if st.local and self.fallback is not None:
            return self._local(slot, p0, t)
        if device_only:   # re-planned to device only mid-sequence: its deep cache is filled here from history
            st.local = True
            return self._local(slot, 0, len(st.history))
        deadline = time.monotonic() + self.opts.deadline_s
        try:
            return self._remote(st, h16, positions, start=p0 == 0, deadline=deadline)
        except (_Transient, _Fatal) as exc:
            self._bump(last_error=str(exc))
            if self.fallback is None:
                raise EdgeError(f"edge {self.url}: {exc}") from None
            self.log(f"edge {self.url} failed ({exc}); running layers {self.spec} on the device from here on")
            st.local = True
            self._bump(fallbacks=1)
            if self.policy is not None:
                self.policy.link_down(str(exc))
            return self._local(slot, 0, len(st.history))

    def stats(self) -> LinkStats:
        return self._stats

    def wait_probe(self, timeout_s: float) -> bool:
        """Wait for a background probe of the edge (re-planning) to end; True when none is running."""
        t = self._probe
        if t is not None:
            t.join(timeout_s)
        return t is None or not t.is_alive()

    def _device_only(self) -> bool:
        """The policy's choice for this step (False without a policy or a local deep slice); while device
        only, starts a background probe of the edge when one is due."""
        pol = self.policy
        if pol is None or self.fallback is None or not pol.local:
            return False
        if pol.probe_due():
            self._probe = threading.Thread(target=self._run_probe, name="edge-probe", daemon=True)
            self._probe.start()
        return True

    def _run_probe(self) -> None:
        from partition.offload.planner import MIN_MBPS, LinkEstimate

        assert self.policy is not None
        try:
            rtt, mbps = self.probe(pings=2, positions=32)
        except Exception as exc:  # noqa: BLE001 - the probe must report back (a closed channel, anything)
            self.policy.probe_done(None, str(exc))   # or the policy would wait on it forever
            return
        est = LinkEstimate(rtt, max(mbps, MIN_MBPS))
        with self._lock:   # a fresh measurement replaces the running averages (stale since the switch)
            self._stats = replace(self._stats, rtt_ms=est.rtt_ms, mbps=est.mbps)
        self.policy.probe_done(est)

    def close(self) -> None:
        """Free this link's sequences on the edge (the last position again, with the end flag: an
        idempotent rewrite of its KV), then the channel. Errors are ignored: the idle timeout frees
        whatever this misses."""
        for st in self._slots:
            if st.history and not st.local:
                p = len(st.history) - 1
                try:
                    self._infer(st.seq_id, st.history[p][None], np.asarray([p], np.int32), p == 0,
                                time.monotonic() + 1.0, end=True)
                except (_Transient, _Fatal, _Lost):
                    pass
            st.history.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.wait_probe(self.opts.deadline_s)
        self.client.close()

    def probe(self, pings: int = 4, positions: int = 128) -> tuple[float, float]:
        """Measure the link with throwaway sequences (start and end flag: the edge keeps nothing): one
        warm-up, `pings` single positions (RTT: their median), then `positions` at once (effective
        bandwidth: the extra bytes over the extra time, the edge's compute included). Returns
        (rtt_ms, mbps); EdgeError when the edge does not answer."""
        seq_id = self._base_id + 255                     # slots use base + 1 .. base + max_batch
        t = max(2, min(positions, self.max_seq))
        ms: list[float] = []
        try:
            for i in range(pings + 2):
                n = t if i == pings + 1 else 1
                t0 = time.monotonic()
                self._infer(seq_id, np.zeros((n, self.hidden), np.float16), np.arange(n, dtype=np.int32), True,
                            time.monotonic() + self.opts.deadline_s, end=True, account=False)
                ms.append((time.monotonic() - t0) * 1e3)
        except (_Transient, _Fatal, _Lost) as exc:
            raise EdgeError(f"edge {self.url}: {exc}") from None
        rtt = float(np.median(ms[1:-1]))
        extra = P.bytes_up(t, self.hidden, self.opts.link_dtype) - P.bytes_up(1, self.hidden, self.opts.link_dtype)
        return rtt, extra * 8 / (max(ms[-1] - rtt, 0.05) * 1e3)

    # --- attempts -------------------------------------------------------------------------------------

    def _remote(self, st: _Slot, h16: np.ndarray, positions: np.ndarray, start: bool, deadline: float) -> np.ndarray:
        last: Exception | None = None
        rebuild = False
        for attempt in range(self.opts.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if attempt:
                self._bump(retries=1)
                time.sleep(min(0.1 * 2 ** attempt, left / 4))
            try:
                if rebuild:
                    full = np.stack(st.history)
                    self._bump(rebuilds=1)
                    return self._infer(st.seq_id, full, np.arange(len(full), dtype=np.int32), True, deadline)
                return self._infer(st.seq_id, h16, positions, start, deadline)
            except _Lost as exc:
                last, rebuild = exc, True
            except _Transient as exc:
                last = exc
        raise _Transient(f"no answer within {self.opts.deadline_s:g} s after {self.opts.retries} retries "
                         f"(last: {last})")

    def _infer(self, seq_id: int, h16: np.ndarray, positions: np.ndarray, start: bool, deadline: float,
               end: bool = False, account: bool = True) -> np.ndarray:
        g = self._grpc
        t = h16.shape[0]
        if self.opts.link_dtype == "int8":
            q, scale = P.quantize_rows(h16)
            hidden: dict[str, np.ndarray] = {P.HIDDEN_I8: q[None], P.HIDDEN_SCALE: scale[None]}
        else:
            hidden = {P.HIDDEN: h16[None]}
        arrays: dict[str, np.ndarray] = {
            **hidden, P.POSITIONS: np.asarray(positions, dtype=np.int32)[None],
            P.SPLIT: np.asarray([[self.spec.start]], dtype=np.int32),
            P.WANT_LOGITS: np.asarray([[self.opts.want_logits]], dtype=np.bool_)}
        if not self.opts.sequence_params:
            arrays.update({P.SEQ_ID: np.asarray([[seq_id]], dtype=np.uint64),
                           P.SEQ_START: np.asarray([[start]], dtype=np.bool_),
                           P.SEQ_END: np.asarray([[end]], dtype=np.bool_)})
        inputs = []
        for name, arr in arrays.items():
            inp = g.InferInput(name, list(arr.shape), "BOOL" if arr.dtype == np.bool_ else g.np_to_triton_dtype(arr.dtype))
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        up, down = P.bytes_up(t, self.hidden, self.opts.link_dtype), P.bytes_down(self.vocab, self.opts.want_logits)
        timeout = max(0.05, min(self.opts.timeout_s, deadline - time.monotonic()))
        t0 = time.monotonic()
        if self.shape is not None:
            time.sleep(min(self.shape.delay_s(up + down), timeout))
        seq_kw: dict[str, Any] = {}
        if self.opts.sequence_params:
            seq_kw = {"sequence_id": seq_id, "sequence_start": start, "sequence_end": end}
        headers = auth_headers(self.opts.token) or None
        try:
            res = self.client.infer(P.MODEL_NAME, inputs, headers=headers, client_timeout=timeout, **seq_kw)
        except g.InferenceServerException as exc:  # type: ignore[attr-defined]
            msg = short_error(f"{exc.status() or ''} {exc.message() or exc}".strip())
            if P.SESSION_LOST in msg:
                raise _Lost(msg) from None
            if P.AT_CAPACITY in msg or "restricted" in msg.lower() or "unauthenticated" in msg.lower():
                raise _Fatal(msg) from None
            raise _Transient(msg) from None
        reply = self._check(res)
        ms = (time.monotonic() - t0) * 1e3
        if account:
            with self._lock:
                self._account(t, up, down, ms)
            if self.policy is not None and self.fallback is not None:
                s = self._stats
                self.policy.observe(s.rtt_ms, s.mbps)
        return reply.logits if reply.logits is not None else P.logits_from_topk(reply, self.vocab)

    def _account(self, t: int, up: int, down: int, ms: float) -> None:
        s = self._stats
        rtt = ms if s.rtt_ms == 0 else (0.8 * s.rtt_ms + 0.2 * ms if t == 1 else s.rtt_ms)
        mbps = s.mbps
        if t > 1 and s.rtt_ms > 0:   # the extra positions' bytes over the extra time (edge compute included)
            extra_ms = max(ms - s.rtt_ms, 0.05)
            est = (up - P.bytes_up(1, self.hidden, self.opts.link_dtype)) * 8 / (extra_ms * 1e3)
            mbps = est if mbps == 0 else 0.5 * mbps + 0.5 * est
        self._stats = replace(s, round_trips=s.round_trips + 1, positions_sent=s.positions_sent + t,
                              bytes_up=s.bytes_up + up, bytes_down=s.bytes_down + down, rtt_ms=rtt,
                              wait_s=s.wait_s + ms / 1e3, mbps=mbps)

    def _check(self, res: Any) -> P.DeepReply:
        """The reply, or _Transient when it is not what the protocol promises (garbage)."""
        try:
            tok = res.as_numpy(P.NEXT_TOKEN)
            ids, lp = res.as_numpy(P.TOPK_IDS), res.as_numpy(P.TOPK_LOGPROBS)
            logits = res.as_numpy(P.LOGITS) if self.opts.want_logits else None
        except (ValueError, TypeError) as exc:
            raise _Transient(f"malformed reply: {exc}") from None
        ok = (tok is not None and tok.size == 1 and 0 <= int(tok.reshape(-1)[0]) < self.vocab
              and ids is not None and lp is not None and ids.size == lp.size and ids.size > 0
              and bool(np.all((ids >= 0) & (ids < self.vocab))) and bool(np.all(np.isfinite(lp))))
        if ok and self.opts.want_logits:
            ok = logits is not None and logits.size == self.vocab and bool(np.all(np.isfinite(logits)))
        if not ok:
            raise _Transient("malformed reply: tensors out of range, non-finite or of the wrong size")
        row = None if logits is None else logits.reshape(-1).astype(np.float32)
        return P.DeepReply(int(tok.reshape(-1)[0]), ids.reshape(-1), lp.reshape(-1), row)

    def _local(self, slot: int, p0: int, t: int) -> np.ndarray:
        with self._lock:
            return self._local_locked(slot, p0, t)

    def _local_locked(self, slot: int, p0: int, t: int) -> np.ndarray:
        assert self.fallback is not None
        st = self._slots[slot]
        h = np.stack(st.history[p0:p0 + t]).astype(np.float32)[None]
        pos = np.arange(p0, p0 + t, dtype=np.int32)[None]
        from partition.runners.chain import convert
        out = self.fallback.run(convert(h, self.fallback.array_kind), pos, [slot])
        return np.asarray(convert(out, "numpy"), dtype=np.float32)[0]

    def _bump(self, **inc: Any) -> None:
        with self._lock:
            s = self._stats
            kw = {k: (v if isinstance(v, str) else getattr(s, k) + v) for k, v in inc.items()}
            self._stats = replace(s, **kw)
