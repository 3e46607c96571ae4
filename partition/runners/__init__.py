"""Runners: one slice of the model on one backend (base.py: the contract; torch_runner.py and ort_runner.py:
the PyTorch and ONNX Runtime backends, partition.trt.runner the TensorRT one; chain.py: slices in
sequence; chain_loader.py: `load_chain`, the one entry point). This module only wires the public names together."""
from partition.runners.base import MAX_SEQ_CAP, SliceRunner
from partition.runners.chain import Chain
from partition.runners.chain_loader import BACKENDS, BackendUnavailable, load_chain
from partition.slices import SliceSpec, parse_slices

__all__ = ["BACKENDS", "MAX_SEQ_CAP", "BackendUnavailable", "Chain", "SliceRunner", "SliceSpec", "load_chain",
           "parse_slices"]
