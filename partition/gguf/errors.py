"""The one error of GGUF loading, apart so that the folder (light: paths and aliases) and the reader (numpy
and gguf) both raise it without importing each other."""
from __future__ import annotations


class GGUFError(ValueError):
    """A GGUF file this runtime cannot load; the message names the file, the key or tensor, and what to do."""
