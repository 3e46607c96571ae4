"""Offload of the deep layers to an edge server running Triton Inference Server.

protocol: the wire contract (tensor names, markers) · sessions: the server's per-sequence state ·
server: the PyTriton host (`python -m partition.offload.server`) · repository: a standalone Triton
model repository · launch: the server as a child process under its own interpreter · link: the
device-side runner over gRPC · offload_chain: [local 0:N] + [edge N:L] · planner: where to split.
"""
from __future__ import annotations

from partition.offload.offload_chain import make_offload_chain
from partition.offload.link import EdgeError, EdgeLink, LinkOptions, LinkShape, LinkStats

__all__ = ["EdgeError", "EdgeLink", "LinkOptions", "LinkShape", "LinkStats", "make_offload_chain"]
