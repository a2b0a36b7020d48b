"""The log lines an operator reads: an exception logged with `log.exception` keeps its type,
message and traceback, in JSON (a pod) and on a terminal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = """
import structlog
from dra_driver import log
log.configure("info", "{fmt}")
logger = structlog.get_logger("t")
try:
    raise ValueError("the checkpoint is a directory")
except ValueError:
    logger.exception("writing the CDI spec failed", claim_name="c")
"""


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_log_exception_keeps_the_exception(fmt: str) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD.format(fmt=fmt)], capture_output=True, text=True,
                         check=True, timeout=60).stderr
    assert "writing the CDI spec failed" in out
    if fmt == "json":
        line = json.loads(out.strip().splitlines()[-1])
        (exc,) = line["exception"]
        assert (exc["exc_type"], exc["exc_value"]) == ("ValueError", "the checkpoint is a directory")
        assert exc["frames"], line
    else:
        assert "ValueError" in out and "the checkpoint is a directory" in out and "Traceback" in out
