"""The wire contract between the device and the edge server: tensor names, dtypes and the error
markers both sides share (KServe v2 / Open Inference Protocol tensors over Triton's gRPC).

One request carries T consecutive positions of ONE sequence: the hidden states entering layer N
(FP16, T x D), their positions, the split N, the sequence id and start/end flags (also sent as the
protocol's own `sequence_id`/`sequence_start`/`sequence_end` request parameters, which a standalone
Triton's sequence batcher uses to route and time out sequences). T > 1 is a prefill, a session
rebuild, or a backlog of hidden states that exited early on the device. The reply is the next token
after the last position, its top-k ids and log-probabilities, and (when asked) the full logits.

Kept free of torch and of tritonclient: the edge side (numpy < 2 for Triton's Python backend) and
the device side both import it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODEL_NAME = "deep_slice"
TOP_K = 8

# inputs
HIDDEN = "HIDDEN"            # FP16 [T, D]; or, with link dtype int8, the two below instead
HIDDEN_I8 = "HIDDEN_I8"      # INT8 [T, D]: per-position symmetric int8 ...
HIDDEN_SCALE = "HIDDEN_SCALE"  # FP16 [T]: ... with one scale per position (row)
POSITIONS = "POSITIONS"      # INT32 [T], consecutive
SPLIT = "SPLIT"              # INT32 [1]: first layer the edge runs
SEQ_ID = "SEQ_ID"            # UINT64 [1]
SEQ_START = "SEQ_START"      # BOOL [1]: drop any state of this id, positions start at 0
SEQ_END = "SEQ_END"          # BOOL [1]: free the state after this request
WANT_LOGITS = "WANT_LOGITS"  # BOOL [1]: return the full logits row too
# outputs
NEXT_TOKEN = "NEXT_TOKEN"    # INT32 [1]: greedy next token
TOPK_IDS = "TOPK_IDS"        # INT32 [TOP_K]
TOPK_LOGPROBS = "TOPK_LOGPROBS"  # FP32 [TOP_K]
LOGITS = "LOGITS"            # FP32 [V] when WANT_LOGITS, else [1] (a placeholder: PyTriton cannot send empty tensors)

# An error message containing this marker means the server holds no state for the sequence (it was
# restarted, or the state timed out or was evicted): the device resends the whole history.
SESSION_LOST = "SESSION_LOST"
# The server is at its cap of live sequences; the device falls back or reports.
AT_CAPACITY = "AT_CAPACITY"


@dataclass(frozen=True)
class DeepReply:
    """The edge's answer for one request: next token, top-k and (optionally) logits (V,)."""

    next_token: int
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    logits: np.ndarray | None


def reply_arrays(logits: np.ndarray, want_logits: bool) -> dict[str, np.ndarray]:
    """The output tensors for one logits row (V,) float32."""
    row = np.asarray(logits, dtype=np.float32)
    shifted = row - row.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    k = min(TOP_K, row.shape[0])
    top = np.argsort(-row, kind="stable")[:k]
    return {NEXT_TOKEN: np.asarray([int(np.argmax(row))], dtype=np.int32),
            TOPK_IDS: top.astype(np.int32), TOPK_LOGPROBS: logprobs[top].astype(np.float32),
            LOGITS: row if want_logits else np.zeros((1,), dtype=np.float32)}


def logits_from_topk(reply: DeepReply, vocab: int, floor: float = -1e4) -> np.ndarray:
    """A logits row (V,) from the top-k alone: the k log-probs, every other token at `floor`.
    Greedy decoding on it picks exactly the server's argmax; sampling is limited to the top-k."""
    row = np.full((vocab,), floor, dtype=np.float32)
    row[reply.topk_ids] = reply.topk_logprobs
    return row


LINK_DTYPES = ("fp16", "int8")


def quantize_rows(h16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(T, D) hidden states -> (int8 (T, D), FP16 scales (T,)): symmetric per position, scale = max|h| / 127
    (a row of zeros gets scale 1). Deterministic, so a resent history dequantises to the same values."""
    h = np.asarray(h16, dtype=np.float32)
    amax = np.abs(h).max(axis=-1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float16)
    q = np.clip(np.rint(h / scale.astype(np.float32)[:, None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The FP16 (T, D) hidden states the edge computes with."""
    return (q.astype(np.float32) * np.asarray(scale, dtype=np.float32).reshape(-1, 1)).astype(np.float16)


def bytes_up(t: int, hidden: int, link_dtype: str = "fp16") -> int:
    """Payload bytes the device sends for T positions (hidden states + positions + controls): FP16
    rows, or int8 rows plus one FP16 scale each."""
    rows = t * hidden * 2 if link_dtype == "fp16" else t * hidden + t * 2
    return rows + t * 4 + 4 + 8 + 3


def bytes_down(vocab: int, want_logits: bool) -> int:
    return 4 + TOP_K * 8 + (vocab * 4 if want_logits else 0)
