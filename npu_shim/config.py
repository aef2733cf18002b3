"""Every environment variable the shim reads, declared once and parsed in one place.

Upstream's own names are kept verbatim (``SGLANG_ZBAL_*``, ``SGLANG_NPU_USE_MULTI_STREAM``) so a
job configured for a newer sglang configures the shim identically; the shim's own knobs live under
``NPU_SHIM_``.  Parsing never raises: a bad value becomes a ``ConfigError`` whose message names the
variable, the value and the accepted form, and the consumer decides what that means (a patch that
reads it ends ``failed``; strict mode raises).

Cheap on purpose: imported from the bootstrap, so only ``os`` and ``re``.
"""

import os
import re

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_URL = re.compile(r"^tcp://(?P<host>\[[^\]]*\]|[^:/\[\]]*):(?P<port>[^:]*)$")
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: int() would also take "１２２８８"
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# No NPU holds more than this (Ascend 910B: 64 GiB); a larger size is a typo, not a budget.
MAX_MIB = 1 << 20  # 1 TiB


class ConfigError(ValueError):
    """A variable is set to something the shim cannot accept."""


def _parse_bool(raw):
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("expected a boolean: one of 1/0, true/false, yes/no, on/off")


def _parse_mib(raw):
    value = raw.strip()
    if value.startswith("-") and _DIGITS.fullmatch(value[1:]):
        raise ValueError("expected a whole number of MiB >= 0 (0 turns zbal off)")
    if not _DIGITS.fullmatch(value):
        raise ValueError("expected a whole number of MiB, e.g. 12288 for 12 GiB (no unit suffix; "
                         "ASCII digits)")
    if len(value) > 12 or int(value) > MAX_MIB:
        raise ValueError("expected at most %d MiB (1 TiB, more than any NPU holds)" % MAX_MIB)
    return int(value)


def _valid_host(host):
    """A DNS name (RFC 1123 labels), a dotted IPv4 address or a bracketed IPv6 address."""
    import ipaddress  # only when a URL is set

    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    labels = host.split(".")
    if all(label.isascii() and label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return len(host) <= 253 and all(_LABEL.fullmatch(label) for label in labels)


def _parse_url(raw):
    value = raw.strip()
    if value == "":
        return ""
    match = _URL.match(value)
    port = match.group("port") if match else ""
    if (not match or not _valid_host(match.group("host")) or not _DIGITS.fullmatch(port)
            or len(port) > 5 or not 0 < int(port) < 65536):
        raise ValueError("expected tcp://HOST:PORT with a port in 1..65535, e.g. tcp://10.0.0.1:6789 "
                         "(HOST: a hostname, IPv4 or [IPv6] address; ASCII digits)")
    return value


def _parse_level(raw):
    value = raw.strip().upper()
    if value not in _LEVELS:
        raise ValueError("expected one of " + ", ".join(_LEVELS))
    return value


def _shown(raw, limit=60):
    """The value as it appears in a message: repr (escapes, ANSI and undecodable bytes show as
    such), cut to ``limit`` characters."""
    return repr(raw) if len(raw) <= limit else repr(raw[:limit]) + "..."


class EnvVar:
    """One variable: its name, how it parses, its default and a one-line doc."""

    def __init__(self, name, kind, default, doc, parse):
        self.name = name
        self.kind = kind
        self.default = default
        self.doc = doc
        self._parse = parse

    def read(self, environ=None):
        """Parsed value (default when unset or empty); raises ConfigError on a bad value."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        try:
            return self._parse(raw)
        except ValueError as exc:
            raise ConfigError("%s=%s is invalid: %s" % (self.name, _shown(raw), exc)) from None

    def is_set(self, environ=None):
        raw = (os.environ if environ is None else environ).get(self.name)
        return raw is not None and raw.strip() != ""

    def __repr__(self):
        return "EnvVar(%s)" % self.name


def _bool(name, default, doc):
    return EnvVar(name, "bool", default, doc, _parse_bool)


# -- the shim's own switches -------------------------------------------------------------------
ENABLED = _bool("NPU_SHIM_ENABLED", True, "Master switch: 0 leaves sglang untouched in every process.")
ACTIVATE = _bool(
    "NPU_SHIM_ACTIVATE", False,
    "pip-installed npu-shim only: 1 activates it in every Python process (its .pth reads this).")
STRICT = _bool(
    "NPU_SHIM_STRICT", False,
    "Raise instead of logging when a patch cannot be applied (for CI of a user's image).")
LOG_LEVEL = EnvVar(
    "NPU_SHIM_LOG_LEVEL", "level", "INFO", "Level of the 'npu_shim' logger (DEBUG, INFO, WARNING, ERROR).",
    _parse_level)
ZBAL = _bool("NPU_SHIM_ZBAL", True, "Switch for the zbal allocator backport (also needs SGLANG_ZBAL_LOCAL_MEM_SIZE).")
MLA_WEIGHT_RELEASE = _bool(
    "NPU_SHIM_MLA_WEIGHT_RELEASE", True,
    "Switch for freeing MLA weights the mlaprolog path no longer reads (PD disaggregation only).")
MLA_RELEASE_FORCE = _bool(
    "NPU_SHIM_MLA_RELEASE_FORCE", False,
    "Release MLA weights even when the server can reload or adapt weights (LoRA, weight updates).")
DUAL_STREAM = _bool(
    "NPU_SHIM_DUAL_STREAM", True,
    "Switch for the GLM-4.x MoE dual-stream experts and fused qkv-rmsnorm-rope backport.")

# -- upstream's names, same meaning as in sglang's environ.py ------------------------------------
ZBAL_LOCAL_MEM_SIZE = EnvVar(
    "SGLANG_ZBAL_LOCAL_MEM_SIZE", "MiB", 0,
    "Device memory zbal manages, in MiB (at most 1048576 = 1 TiB); > 0 turns zbal on (upstream name "
    "and meaning).", _parse_mib)
ZBAL_BOOTSTRAP_URL = EnvVar(
    "SGLANG_ZBAL_BOOTSTRAP_URL", "url", "",
    "tcp://HOST:PORT (hostname, IPv4 or [IPv6]; port 1-65535) of zbal's bootstrap server; empty "
    "lets zbal derive it from MASTER_ADDR/PORT.",
    _parse_url)
NPU_USE_MULTI_STREAM = _bool(
    "SGLANG_NPU_USE_MULTI_STREAM", False,
    "Run GLM-4.x shared experts on a side stream during extend/verify (upstream name and meaning).")

ALL = (
    ENABLED, ACTIVATE, STRICT, LOG_LEVEL, ZBAL, MLA_WEIGHT_RELEASE, MLA_RELEASE_FORCE, DUAL_STREAM,
    ZBAL_LOCAL_MEM_SIZE, ZBAL_BOOTSTRAP_URL, NPU_USE_MULTI_STREAM,
)
BY_NAME = {var.name: var for var in ALL}


def read_all(environ=None):
    """{name: (value, error)} for every variable; error is None or the ConfigError message."""
    result = {}
    for var in ALL:
        try:
            result[var.name] = (var.read(environ), None)
        except ConfigError as exc:
            result[var.name] = (None, str(exc))
    return result
