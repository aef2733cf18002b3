"""Every environment variable the shim reads, declared once and parsed in one place.

Upstream's own names are kept verbatim (a patch reads upstream's ``SGLANG_*`` variables) so a
job configured for a newer sglang configures the shim identically; the shim's own knobs live under
``NPU_SHIM_``.  Parsing never raises: a bad value becomes a ``ConfigError`` whose message names the
variable, the value and the accepted form, and the consumer decides what that means (a patch that
reads it ends ``failed``; strict mode raises).

The shim-wide variables live here; a patch declares its own switch (``switch(name, doc)``: always
``NPU_SHIM_<PATCH NAME>``) and the variables only it reads in its own module, with the parsers
below, so ``npu_shim.core.loading.all_variables()`` is the full list.  Only ``os`` and ``re`` are
imported (and the registry's list of patch names beside it, npu_shim/core/registry.py, for
``NPU_SHIM_PATCHES``): ``status`` and the runtime load this, and the bootstrap on its error path.
"""

import os
import re


# How every boolean variable is spelled.  The bootstrap spells them too, in its own copy (it runs
# in every process and imports nothing of the shim); tests/core/test_config.py holds them equal.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
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
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ValueError("expected a boolean: one of 1/0, true/false, yes/no, on/off")


def _parse_mib(raw, zero_means=None):
    value = raw.strip()
    if value.startswith("-") and _DIGITS.fullmatch(value[1:]):
        raise ValueError("expected a whole number of MiB >= 0%s"
                         % (" (0 %s)" % zero_means if zero_means else ""))
    if not _DIGITS.fullmatch(value):
        raise ValueError("expected a whole number of MiB, e.g. 12288 for 12 GiB (no unit suffix; "
                         "ASCII digits)")
    digits = value.lstrip("0") or "0"  # the number, then its length: 0000000000000 is 0 (off)
    if len(digits) > 12 or int(digits) > MAX_MIB:
        raise ValueError("expected at most %d MiB (1 TiB, more than any NPU holds)" % MAX_MIB)
    return int(digits)


def _valid_host(host):
    """A DNS name (RFC 1123 labels), a dotted IPv4 address or a bracketed IPv6 address (with an
    optional %scope).  ``socket.inet_pton`` judges the addresses (``ipaddress`` would be loaded into
    every process that sets a URL)."""
    import socket

    if host.startswith("["):
        address, _, scope = host[1:-1].partition("%")
        if "%" in host and not re.fullmatch(r"[A-Za-z0-9_.-]+", scope):
            return False
        return _is_address(socket.AF_INET6, address)
    labels = host.split(".")
    if all(label.isascii() and label.isdigit() for label in labels):
        return _is_address(socket.AF_INET, host)
    return len(host) <= 253 and all(_LABEL.fullmatch(label) for label in labels)


def _is_address(family, text):
    import socket

    try:
        socket.inet_pton(family, text)
    except (OSError, ValueError):
        return False
    return True


def _valid_port(port):
    """1..65535 in at most 5 ASCII digits."""
    return _DIGITS.fullmatch(port) and len(port) <= 5 and 0 < int(port) < 65536


def _parse_url(raw):
    value = raw.strip()
    match = _URL.match(value)
    if not match or not _valid_host(match.group("host")) or not _valid_port(match.group("port")):
        raise ValueError("expected tcp://HOST:PORT with a port in 1..65535, e.g. tcp://10.0.0.1:6789 "
                         "(HOST: a hostname, IPv4 or [IPv6] address; ASCII digits)")
    return value


def _one_of(value, choices):
    if value not in choices:
        raise ValueError("expected one of " + ", ".join(choices))
    return value


def _parse_level(raw):
    return _one_of(raw.strip().upper(), _LEVELS)


def _parse_log_format(raw):
    return _one_of(raw.strip().lower(), LOG_FORMATS)


LOG_FORMATS = ("text", "json")


def _shown(raw, limit=60):
    """The value as it appears in a message: repr (escapes, ANSI and undecodable bytes show as
    such), cut to ``limit`` characters."""
    return repr(raw) if len(raw) <= limit else repr(raw[:limit]) + "..."


class EnvVar:
    """One variable: its name, how it parses, its default and a one-line doc.  ``aliases``: older
    names still read (the name itself wins when both are set)."""

    def __init__(self, name, kind, default, doc, parse, aliases=()):
        self.name = name
        self.kind = kind
        self.default = default
        self.doc = doc
        self._parse = parse
        self.aliases = tuple(aliases)

    def name_set(self, environ=None):
        """The name (or alias) this variable is set under in ``environ``, else None."""
        environ = os.environ if environ is None else environ
        for name in (self.name,) + self.aliases:
            raw = environ.get(name)
            if raw is not None and raw.strip() != "":
                return name
        return None

    def read(self, environ=None):
        """Parsed value (default when unset or empty); raises ConfigError on a bad value."""
        name = self.name_set(environ)
        if name is None:
            return self.default
        raw = (os.environ if environ is None else environ)[name]
        try:
            return self._parse(raw)
        except ValueError as exc:
            raise ConfigError("%s=%s is invalid: %s" % (name, _shown(raw), exc)) from None

    def is_set(self, environ=None):
        return self.name_set(environ) is not None

    def __repr__(self):
        return "EnvVar(%s)" % self.name


def boolean(name, default, doc, aliases=()):
    return EnvVar(name, "bool", default, doc, _parse_bool, aliases)


def mib(name, doc, zero_means=None):
    """A size in MiB, 0 by default, at most MAX_MIB; ``zero_means``: what 0 does, for messages
    (e.g. "turns X off")."""
    return EnvVar(name, "MiB", 0, doc, lambda raw: _parse_mib(raw, zero_means))


def url(name, doc):
    """tcp://HOST:PORT, empty by default."""
    return EnvVar(name, "url", "", doc, _parse_url)


SWITCH_PREFIX = "NPU_SHIM_"


def switch_name(patch_name):
    return SWITCH_PREFIX + patch_name.upper()


def switch(patch_name, doc, aliases=()):
    """A patch's own switch, ``NPU_SHIM_<PATCH NAME>`` (on by default)."""
    return boolean(switch_name(patch_name), True, doc, aliases)


def _parse_names(raw):
    from npu_shim.core.registry import known_names  # a list of names: no feature module loads

    known = known_names()
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError("expected patch names separated by commas, out of: %s" % ", ".join(known))
    return names


# -- the shim's own variables ---------------------------------------------------------------------
ENABLED = boolean("NPU_SHIM_ENABLED", True, "Master switch: 0 leaves sglang untouched in every process.")
ACTIVATE = boolean(
    "NPU_SHIM_ACTIVATE", False,
    "pip-installed npu-shim only: 1 activates it in every Python process (its .pth reads this).")
STRICT = boolean(
    "NPU_SHIM_STRICT", False,
    "Raise when a patch is unsupported or failed (for CI of a user's image); inactive is fine.")
LOG_LEVEL = EnvVar(
    "NPU_SHIM_LOG_LEVEL", "level", "INFO", "Level of the 'npu_shim' logger (DEBUG, INFO, WARNING, ERROR).",
    _parse_level)
PATCHES = EnvVar(
    "NPU_SHIM_PATCHES", "names", None,
    "Allow-list for canaries: only these patches (comma-separated names) may apply; unset: all.",
    _parse_names)

LOG_FORMAT = EnvVar(
    "NPU_SHIM_LOG_FORMAT", "format", "text",
    "Shim log lines as text ('[npu-shim 0.2.2 sglang 0.5.11 pid 812 tp 3/16] ...') or json "
    "(one object per line, for log pipelines).", _parse_log_format)

SHIM_VARIABLES = (ENABLED, ACTIVATE, STRICT, LOG_LEVEL, LOG_FORMAT, PATCHES)
# Set by npu-shim's dev tooling (the test cache), not by users.
INTERNAL_NAMES = ("NPU_SHIM_CACHE",)


def read_all(variables, environ=None):
    """{name: (value, error)} for ``variables``; error is None or the ConfigError message."""
    result = {}
    for var in variables:
        try:
            result[var.name] = (var.read(environ), None)
        except ConfigError as exc:
            result[var.name] = (None, str(exc))
    return result


def unknown_names(variables, environ=None):
    """``NPU_SHIM_*`` names set in ``environ`` that no variable reads: [(name, suggestion or None)].
    A suggestion is a user's variable whose name after the prefix is close to the unknown one's
    (the shared prefix alone would make any long name look like a typo of another)."""
    environ = os.environ if environ is None else environ
    users = set()
    for var in variables:
        users.update((var.name,) + var.aliases)
    known = users.union(INTERNAL_NAMES)
    unknown = sorted(n for n in environ if n.startswith(SWITCH_PREFIX) and n not in known)
    if not unknown:
        return []
    import difflib  # only when there is a typo to name

    stems = sorted(n[len(SWITCH_PREFIX):] for n in users)

    def suggestion(name):
        match = difflib.get_close_matches(name[len(SWITCH_PREFIX):], stems)
        return SWITCH_PREFIX + match[0] if match else None

    return [(n, suggestion(n)) for n in unknown]
