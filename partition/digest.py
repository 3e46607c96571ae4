"""SHA-256 for the build caches' keys (partition/gguf/folder.py, partition/build/decoder_build.py) from CPython's
own built-in module when it has one, so the CPU generate path does not load OpenSSL: `import hashlib` maps
libcrypto, 3.5 MB of resident memory measured here beside numpy and onnxruntime (docs/BENCHMARKS.md), for a
key of a few hundred bytes. The digests are the same (the algorithm is fixed: FIPS 180-4); hashlib is the
fallback where the built-in module is absent (its name is `_sha256` up to Python 3.11, `_sha2` from 3.12).
"""
from __future__ import annotations

from typing import Any, Callable

_sha256: Callable[..., Any]
try:
    from _sha2 import sha256 as _sha256  # Python >= 3.12
except ImportError:
    try:
        from _sha256 import sha256 as _sha256  # Python 3.10 / 3.11
    except ImportError:
        from hashlib import sha256 as _sha256


def sha256(data: bytes = b"") -> Any:
    """A SHA-256 hash object (update / hexdigest / digest, as hashlib's) over `data`."""
    return _sha256(data)
