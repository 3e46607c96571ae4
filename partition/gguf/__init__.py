"""GGUF model files (llama.cpp / Ollama): the header as a ModelConfig (reader), the tensors as the one model
definition with block-quantised projections kept as codes (tensors, quants), the tokenizer (tokenizer)."""
from partition.gguf.reader import GGUFError, GGUFModel, read_model
from partition.gguf.tensors import layout, load_gguf_model
from partition.gguf.tokenizer import GGUFTokenizer, build_tokenizer

__all__ = ["GGUFError", "GGUFModel", "GGUFTokenizer", "build_tokenizer", "layout", "load_gguf_model", "read_model"]
