"""Text for an operator's terminal: what a variable, sglang's files or a child process
wrote is shown escaped, never raw.  Imports nothing at load time (``check`` uses it before it has
verified the bundle it runs from)."""

import sys

_CONTROLS = None


def printable(text):
    """``text`` with every character that can move a terminal's cursor, change its state or
    reorder what it shows (C0 and C1 controls, DEL, line and paragraph separators, bidi and
    zero-width format characters) written as a ``\\x..`` / ``\\u....`` escape: one line, as sent.
    Lone surrogates too -- the bytes of a path or variable that are not UTF-8, as Python decodes
    them (``\\udcff``): no UTF-8 terminal can be written one, so unescaped they end the command
    with UnicodeEncodeError."""
    global _CONTROLS
    if _CONTROLS is None:
        import re

        _CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e"
                               "\u2060-\u2069\ufeff\ud800-\udfff]")
    return _CONTROLS.sub(_escape, str(text))


def terminal_writer(stream=None):
    """``write`` for text going to an operator: each line escaped (``printable``), so that values
    from the environment, sglang's files or a child's output cannot drive the terminal."""
    stream = stream or sys.stdout
    return lambda text: stream.write("\n".join(printable(line) for line in str(text).split("\n")))


def print_json(value, **options):
    """``value`` on stdout as indented JSON, then a newline: what a command's ``--json`` prints
    (``options``: json.dump's, e.g. ``default=str``).  JSON escapes every control character
    itself, so nothing here needs ``printable``."""
    import json

    json.dump(value, sys.stdout, indent=2, **options)
    sys.stdout.write("\n")


def _escape(match):
    code = ord(match.group())
    return "\\x%02x" % code if code < 0x100 else "\\u%04x" % code
