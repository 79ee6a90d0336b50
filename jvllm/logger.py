"""Logging for jvllm: `JVLLM_LOGGING_LEVEL=DEBUG` shows what the engine does each step."""

import logging
import os
import sys

_ROOT = "jvllm"
_configured = False


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record arrives, not when jvllm was imported:
    compiling threads log after a caller (pytest's capture, a notebook) swapped it back."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ sets it; the property ignores it
        pass


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    level = os.environ.get("JVLLM_LOGGING_LEVEL", "INFO").upper()
    root = logging.getLogger(_ROOT)
    if level not in logging.getLevelNamesMapping():
        raise ValueError(
            f"JVLLM_LOGGING_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, got {level!r}"
        )
    root.setLevel(level)
    handler = _StderrHandler()
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
    )
    root.addHandler(handler)
    root.propagate = False


def init_logger(name: str) -> logging.Logger:
    """A logger under the `jvllm` namespace, configured from `JVLLM_LOGGING_LEVEL`."""
    _configure_root()
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)
