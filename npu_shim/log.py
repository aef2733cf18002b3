"""The shim's one logger, ``npu_shim``; lines read ``[npu-shim] <message>``.

If the application has configured no handler for it (or for the root logger) by the time the shim
first logs, a stderr handler is attached so the per-patch lines are seen in every process.
"""

import logging
import os
import sys

LOGGER_NAME = "npu_shim"
logger = logging.getLogger(LOGGER_NAME)
_reported = set()
_configured = False


def configure():
    global _configured
    if _configured:
        return
    _configured = True
    from npu_shim import config

    try:
        level, problem = config.LOG_LEVEL.read(), None
    except config.ConfigError as exc:
        level, problem = "INFO", exc
    logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[npu-shim] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    if problem is not None:  # only now: the handler that adds the prefix exists
        error_once(config_key(config.LOG_LEVEL), "%s (using INFO)" % problem)


def config_key(var):
    """The ``error_once`` key of an invalid variable: each is reported once per process."""
    return "config:" + var.name


def _emit(level, message):
    logger.log(level, message)


MAX_LINE = 300  # characters of one log line; longer messages are cut (a reason, never a file)


def one_line(message, limit=MAX_LINE):
    """``message`` on one line of at most ``limit`` characters."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def log(level, message):
    configure()
    _emit(level, one_line(message))


def info(message):
    log(logging.INFO, message)


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


def process_tag():
    return "pid %d" % os.getpid()
