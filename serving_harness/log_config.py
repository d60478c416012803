"""The log4j2 configuration every harness-started TorchServe runs with.

TorchServe's built-in configuration rolls each log file by size *and* at midnight.  The midnight roll
moves ``model_log.log`` to ``model_log.<dd-MMM>.log.gz`` and starts an empty file, so anything reading
the log across midnight (a test looking for a worker's start-up line, a bench reading preemption
times from an offset) reads the wrong file.  The harness therefore writes its own configuration:
the same files, loggers and line layouts, rolled by size only, so a file's name is its content
for the server's whole life unless it outgrows ``roll_mb``.

The line layouts are kept as TorchServe writes them because readers match on them: the model log's
lines carry the worker thread's name (``W-<port>-<model>_<version>``) and the metrics logs are
``<time> - <metric line>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import quoteattr

DETAILED_LINE = "%d{ISO8601} [%-5p] %t %c - %m%n"  # time, level, thread, logger: what the model log's readers match
MESSAGE_LINE = "%d{ISO8601} - %m%n"  # time and the line itself: access and metrics logs


@dataclass(frozen=True)
class LogFile:
    """One rolling file: the appender's name is also the file's stem."""

    name: str
    layout: str
    location_env: str = "LOG_LOCATION"


LOG_FILES = (
    LogFile("ts_log", DETAILED_LINE),
    LogFile("model_log", DETAILED_LINE),
    LogFile("access_log", MESSAGE_LINE),
    LogFile("model_metrics", MESSAGE_LINE, "METRICS_LOCATION"),
    LogFile("ts_metrics", MESSAGE_LINE, "METRICS_LOCATION"),
)

# (logger, level, appender or None): where the frontend sends what.  ``org.pytorch.serve`` at debug is
# where registrations, worker starts and scaling are said; MODEL_LOG is the workers' stdout and stderr.
LOGGERS = (
    ("ACCESS_LOG", "info", "access_log"),
    ("MODEL_LOG", "all", "model_log"),
    ("MODEL_METRICS", "all", "model_metrics"),
    ("TS_METRICS", "all", "ts_metrics"),
    ("org.pytorch.serve", "debug", "ts_log"),
    ("io.netty", "error", None),
    ("org.apache", "off", None),
)


def log4j2_xml(roll_mb: int = 100, keep: int = 5) -> str:
    """The configuration's text: every file in ``LOG_FILES`` rolls to ``<name>.<i>.log.gz`` past ``roll_mb``
    (the newest ``keep`` kept), never on a date; the root logger writes to stdout and ``ts_log``."""
    if roll_mb < 1 or keep < 1:
        raise ValueError(f"roll_mb and keep must be at least 1, got {roll_mb} and {keep}")
    appenders = []
    for log in LOG_FILES:
        stem = f"${{env:{log.location_env}:-logs}}/{log.name}"
        appenders.append(
            f"    <RollingFile name={quoteattr(log.name)} fileName={quoteattr(stem + '.log')}"
            f" filePattern={quoteattr(stem + '.%i.log.gz')}>\n"
            f"      <PatternLayout pattern={quoteattr(log.layout)}/>\n"
            f'      <Policies><SizeBasedTriggeringPolicy size="{roll_mb} MB"/></Policies>\n'
            f'      <DefaultRolloverStrategy max="{keep}"/>\n'
            "    </RollingFile>"
        )
    appenders.append(
        f'    <Console name="STDOUT" target="SYSTEM_OUT"><PatternLayout pattern={quoteattr(DETAILED_LINE)}/></Console>'
    )
    loggers = []
    for name, level, appender in LOGGERS:
        if appender is None:
            loggers.append(f"    <Logger name={quoteattr(name)} level={quoteattr(level)}/>")
        else:
            loggers.append(
                f"    <Logger name={quoteattr(name)} level={quoteattr(level)}>"
                f"<AppenderRef ref={quoteattr(appender)}/></Logger>"
            )
    loggers.append('    <Root level="info"><AppenderRef ref="STDOUT"/><AppenderRef ref="ts_log"/></Root>')
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        "<!-- Written by serving_harness.log_config: TorchServe's files and layouts, rolled by size only. -->\n"
        "<Configuration>\n  <Appenders>\n" + "\n".join(appenders) + "\n  </Appenders>\n"
        "  <Loggers>\n" + "\n".join(loggers) + "\n  </Loggers>\n</Configuration>\n"
    )


def write_log_config(path: Path, roll_mb: int = 100, keep: int = 5) -> Path:
    path.write_text(log4j2_xml(roll_mb, keep))
    return path
