"""Logging for jvllm: `JVLLM_LOGGING_LEVEL=DEBUG` shows what the engine does each step."""

import logging
import os
import sys

_ROOT = "jvllm"
_configured = False


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
    handler = logging.StreamHandler(sys.stderr)
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
