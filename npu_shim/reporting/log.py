"""The shim's one logger, ``npu_shim``; lines read ``[npu-shim VERSION sglang VERSION pid 812 tp 3/16]
<message>`` -- the shim's version, then as far as known the running sglang's, the pid and the
process's sglang role (npu_shim/reporting/procinfo.py), so that 16 ranks x N processes can be told apart.

If the application has configured no handler for it (or for the root logger) by the time the shim
first logs, a stderr handler is attached so the shim's lines are seen in every process.  With
``NPU_SHIM_LOG_FORMAT=json`` the shim always attaches its own handler (its lines must stay one JSON
object each): ts, level, pid, host, shim, sglang, role (and ranks), message, plus the fields a line
carries (the summary line: every patch's state).
"""

import json
import logging
import os
import sys
import time

from npu_shim.reporting.terminal import printable

LOGGER_NAME = "npu_shim"
logger = logging.getLogger(LOGGER_NAME)
_reported = set()
_configured = False


def configure():
    global _configured
    if _configured:
        return
    _configured = True
    from npu_shim.core import config

    try:
        level, problem = config.LOG_LEVEL.read(), None
    except config.ConfigError as exc:
        level, problem = "INFO", exc
    try:
        fmt, fmt_problem = config.LOG_FORMAT.read(), None
    except config.ConfigError as exc:
        fmt, fmt_problem = "text", exc
    logger.setLevel(level)
    if not logger.handlers and (fmt == "json" or not logging.getLogger().handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
        logger.addHandler(handler)
        logger.propagate = False
    if problem is not None:  # only now: the handler that adds the prefix exists
        error_once(config_key(config.LOG_LEVEL), "%s (using INFO)" % problem)
    if fmt_problem is not None:
        error_once(config_key(config.LOG_FORMAT), "%s (using text)" % fmt_problem)


def tag():
    """``npu-shim VERSION sglang VERSION pid 812 tp 3/16``: who says it (parts not yet known left out)."""
    from npu_shim._version import __version__
    from npu_shim.reporting import procinfo

    parts = ["npu-shim", __version__]
    sglang = procinfo.sglang_version()
    if sglang:
        parts += ["sglang", sglang]
    parts += ["pid", str(os.getpid())]
    try:
        label = procinfo.role_label()
    except Exception:  # noqa: BLE001 - a tag is never worth an exception
        label = ""
    if label:
        parts.append(label)
    return " ".join(parts)


class TextFormatter(logging.Formatter):
    def format(self, record):
        # The tag carries sglang's version literal and the message values from the environment:
        # neither may split the line or reach a terminal raw.
        return printable("[%s] %s" % (tag(), record.getMessage()))


def json_fields():
    """The fields every JSON line carries."""
    from npu_shim._version import __version__
    from npu_shim.reporting import procinfo

    fields = {"pid": os.getpid(), "host": procinfo.host(), "shim": __version__,
              "sglang": procinfo.sglang_version()}
    try:
        role = procinfo.role()
    except Exception:  # noqa: BLE001 - a log line must not fail over the role it carries
        role = {"role": "unknown"}
    fields.update((k, v) for k, v in role.items() if k != "source")
    return fields


class JsonFormatter(logging.Formatter):
    def format(self, record):
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = {"ts": "%s.%03dZ" % (stamp, int(record.msecs)), "level": record.levelname}
        line.update(json_fields())
        line["message"] = record.getMessage()
        extra = getattr(record, "npu_shim", None)
        if extra:
            line.update(extra)
        return json.dumps(line, default=str, sort_keys=False)


def config_key(var):
    """The ``error_once`` key of an invalid variable: each is reported once per process."""
    return "config:" + var.name


def _emit(level, message, fields=None):
    logger.log(level, message, extra={"npu_shim": fields} if fields else None)


MAX_LINE = 300  # characters of one log line; longer messages are cut (a reason, never a file)


def one_line(message, limit=MAX_LINE):
    """``message`` on one line of at most ``limit`` characters."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def log(level, message, fields=None):
    configure()
    if fields:
        _emit(level, one_line(message), fields)
    else:
        _emit(level, one_line(message))


def info(message, fields=None):
    log(logging.INFO, message, fields)


def warning(message):
    log(logging.WARNING, message)


def error(message):
    log(logging.ERROR, message)


def debug(message):
    log(logging.DEBUG, message)


def error_once(key, message):
    """Log an error only the first time ``key`` is seen in this process."""
    if key in _reported:
        return
    _reported.add(key)
    error(message)


def warning_once(key, message):
    """Log a warning only the first time ``key`` is seen in this process."""
    if key in _reported:
        return
    _reported.add(key)
    warning(message)


def pid_text():
    """``pid N``: this process in a message's own words (the full tag, ``tag()``, starts every line
    the shim's handler writes)."""
    return "pid %d" % os.getpid()
