import json
import logging
import signal
import subprocess
import sys

from meshnode.logs import JsonFormatter


def test_json_lines_carry_level_logger_message_and_extra_fields():
    record = logging.LogRecord(
        "meshnode.node", logging.WARNING, __file__, 1, "peer %s dropped", ("abc",), None
    )
    record.peer = "abc"
    record.reason = "probe failed"
    event = json.loads(JsonFormatter().format(record))
    assert event["level"] == "warning" and event["logger"] == "meshnode.node"
    assert event["msg"] == "peer abc dropped"
    assert (event["peer"], event["reason"]) == ("abc", "probe failed")
    assert event["ts"].endswith("Z")


def test_a_running_node_logs_one_json_object_per_line(tmp_path):
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshnode",
            "create",
            "--log-format",
            "json",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert node.stderr is not None
        first = json.loads(node.stderr.readline())
        assert first["level"] == "info" and "created mesh" in first["msg"]
    finally:
        node.send_signal(signal.SIGTERM)
        _, rest = node.communicate(timeout=30)
    events = [json.loads(line) for line in rest.splitlines() if line.strip()]
    assert all({"ts", "level", "logger", "msg"} <= set(e) for e in events)
