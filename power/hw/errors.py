"""The board layer's error types.

Each is an ``OSError`` (the project's CLI turns ValueError/OSError into a one-line message and exit
code 2, agent/cli/common.py) whose message names the file or command and says what to do.
"""
from __future__ import annotations


class BoardError(OSError):
    """Base of the board layer's errors."""


class BoardWriteError(BoardError):
    """A write the kernel (or the file system) refused; the message names the file."""


class RefusedWrite(BoardWriteError):
    """A write to a path that discovery did not identify as a clock/fan file."""


class JournalError(BoardError):
    """The journal could not be created, read, locked or restored."""


class ToolError(BoardError):
    """nvpmodel / jetson_clocks missing, timed out or failed; the message names the command."""


class FeatureUnavailable(BoardError):
    """The board (or tree) lacks the files a request needs."""
