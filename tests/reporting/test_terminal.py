"""Text for the operator's terminal (npu_shim/reporting/terminal.py): escaped wherever it comes from --
``check``'s report included, whose child imports sglang modules that may say anything."""

import os
import re
import subprocess
import sys

import pytest
from test_bootstrap import REPO, tree  # noqa: F401 - ``tree`` is a fixture

from npu_shim.reporting import terminal

RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202e]")


@pytest.mark.parametrize("text, shown", [
    ("plain text, 0.5.11", "plain text, 0.5.11"),
    ("a\x1b[2Jb", "a\\x1b[2Jb"),
    ("bell\x07", "bell\\x07"),
    ("cr\rlf\n", "cr\\x0dlf\\x0a"),
    ("nel\x85", "nel\\x85"),
    ("line\u2028sep", "line\\u2028sep"),
    ("bidi\u202eoverride", "bidi\\u202eoverride"),
    ("zero\u200bwidth", "zero\\u200bwidth"),
    ("unicode é 中", "unicode é 中"),
    # the bytes of a path or variable that are no UTF-8, as Python decodes them: no UTF-8 terminal
    # takes them (before the fix: UnicodeEncodeError under en_US.UTF-8)
    (b"/srv/\xff\xfe".decode("utf-8", "surrogateescape"), "/srv/\\udcff\\udcfe"),
    ("lone \ud800 high", "lone \\ud800 high"),
])
def test_printable_escapes_what_drives_a_terminal_and_keeps_the_rest(text, shown):
    assert terminal.printable(text) == shown
    assert terminal.printable(terminal.printable(text)) == shown  # escaping twice changes nothing more




def test_check_escapes_what_a_target_module_says_when_it_fails_to_import(tree):
    common = tree / "pkgs" / "sglang" / "srt" / "utils" / "common.py"
    common.write_text("raise RuntimeError('boom \\x1b[2J\\x1b]0;owned\\x07 \\u202e')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_"))}
    env.update({"PYTHONPATH": os.pathsep.join([REPO, str(tree / "image"), str(tree / "pkgs")]),
                "CHAIN_MARKER": str(tree / "marker"), "PYTHONDONTWRITEBYTECODE": "1"})
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "check"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=str(tree))
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "FAILED: RuntimeError: boom \\x1b[2J\\x1b]0;owned\\x07 \\u202e" in proc.stdout, proc.stdout
    assert not RAW_CONTROL.search(proc.stdout + proc.stderr), repr(proc.stdout)


def test_printable_text_always_encodes_as_strict_utf8():
    for text in ("\udcff", "a\ud800b\udfff", "\x00\x1b\u202e\udc80"):
        terminal.printable(text).encode("utf-8")  # strict: what a UTF-8 locale's stdout does


# -- property --------------------------------------------------------------------------------------

from hypothesis import given, strategies as st  # noqa: E402 - the property tests' imports, beside them


@given(text=st.one_of(st.text(), st.binary().map(lambda raw: raw.decode("utf-8", "surrogateescape"))))
def test_printable_is_one_line_a_utf8_terminal_takes_and_escaping_twice_is_once(text):
    shown = terminal.printable(text)
    shown.encode("utf-8")
    assert not RAW_CONTROL.search(shown) and "\n" not in shown
    assert terminal.printable(shown) == shown
