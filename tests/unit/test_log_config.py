"""The harness's log4j2 configuration: TorchServe's files and line layouts, never rolled on a date."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from serving_harness.log_config import DETAILED_LINE, LOG_FILES, log4j2_xml
from serving_harness.torchserve import TorchServeProcess


def appenders(xml: str) -> dict[str, ET.Element]:
    root = ET.fromstring(xml)
    return {a.get("name"): a for a in root.find("Appenders") if a.tag == "RollingFile"}


def test_every_file_rolls_on_size_only_so_a_reader_never_loses_its_file_at_midnight():
    files = appenders(log4j2_xml(roll_mb=7, keep=3))
    assert set(files) == {"ts_log", "model_log", "access_log", "model_metrics", "ts_metrics"}
    for name, appender in files.items():
        triggers = [policy.tag for policy in appender.find("Policies")]
        assert triggers == ["SizeBasedTriggeringPolicy"], name
        assert appender.find("Policies")[0].get("size") == "7 MB"
        assert "%d" not in appender.get("filePattern") and "%i" in appender.get("filePattern"), name
        assert appender.find("DefaultRolloverStrategy").get("max") == "3"
        assert appender.get("fileName").endswith(f"/{name}.log")


def test_the_model_log_keeps_the_worker_thread_in_each_line_and_receives_the_workers_output():
    xml = log4j2_xml()
    assert appenders(xml)["model_log"].find("PatternLayout").get("pattern") == DETAILED_LINE
    assert "%t" in DETAILED_LINE  # readers pick a model's lines by the thread name W-<port>-<model>_<version>
    loggers = {logger.get("name"): logger for logger in ET.fromstring(xml).find("Loggers")}
    assert loggers["MODEL_LOG"].find("AppenderRef").get("ref") == "model_log"
    metrics_home = {log.name: log.location_env for log in LOG_FILES}
    assert metrics_home["model_metrics"] == metrics_home["ts_metrics"] == "METRICS_LOCATION"


@pytest.mark.parametrize(("roll_mb", "keep"), [(0, 5), (100, 0)])
def test_a_config_that_could_not_keep_a_log_is_refused(roll_mb, keep):
    with pytest.raises(ValueError, match="at least 1"):
        log4j2_xml(roll_mb, keep)


def test_reading_the_model_log_as_it_grows_sees_each_line_once(tmp_path):
    """``model_log_read`` hands back where its whole lines end, so a reader that passes it on (bench/reef.py
    counting preemptions between runs) neither misses a line, nor counts one twice, nor gets half of one."""
    server = TorchServeProcess(tmp_path / "ts", tmp_path / "store")
    assert server.model_log_read(0) == ("", 0)  # no log yet: nothing read, nothing skipped
    server.log_dir.mkdir(parents=True)
    with server.model_log.open("a", encoding="utf-8") as log:
        log.write("first ünïcode line\n")
    text, offset = server.model_log_read(0)
    assert text == "first ünïcode line\n" and offset == server.model_log_size()
    with server.model_log.open("a", encoding="utf-8") as log:
        log.write("second line\nthird, being writ")
    assert server.model_log_read(offset) == ("second line\n", offset + len(b"second line\n"))
    text, offset = server.model_log_read(offset)
    with server.model_log.open("a", encoding="utf-8") as log:
        log.write("ten\n")
    assert server.model_log_read(offset) == ("third, being written\n", server.model_log_size())
