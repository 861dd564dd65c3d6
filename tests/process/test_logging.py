"""One JSON log format for every process and logger."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CASES = {
    "configure": "from tokenweir.common.logging import configure; configure('info')",
    # what an app built by create_app does when nothing configured logging (a gateway embedded in a program)
    "ensure_configured": "from tokenweir.common.logging import ensure_configured; ensure_configured('info')",
}


@pytest.mark.parametrize("setup", CASES)
def test_stdlib_and_structlog_records_print_one_json_object_a_line(setup):
    code = f"""
import logging
{CASES[setup]}
from tokenweir.common.logging import get_logger
logging.getLogger("tokenweir.usage").warning("usage flush failed: %s", "store down")
get_logger("tokenweir.gateway").info("request", request_id="req-1")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    by_event = {line["event"]: line for line in lines}
    assert by_event["usage flush failed: store down"]["level"] == "warning"
    assert by_event["usage flush failed: store down"]["logger"] == "tokenweir.usage"
    assert by_event["request"]["request_id"] == "req-1"
    assert all("timestamp" in line for line in lines)
