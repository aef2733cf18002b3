"""The rule every command of ``python -m npu_shim`` keeps (docs/reliability.md): under ``-O``,
``-OO``, ``-S``, ``-I``, ``PYTHONSAFEPATH=1``, a C and a UTF-8 locale, with bytes that are no UTF-8
in variables' names and values and in paths, and with stdout closed or a reader that goes away --
its answer and a documented exit code, never a traceback.

Each command runs here where it answers quickly: ``status`` and ``check`` on the small fake sglang
tree, ``selftest`` without torch (a ``torch``
whose import fails as a missing one), ``bundle`` refused before anything is downloaded, ``env``.
"""

import os
import subprocess
import sys

import pytest

from npu_shim.cli import exit_codes
from test_bootstrap import REPO, tree  # noqa: F401 - ``tree`` is a fixture

# The codes docs/operations.md lists (tests/test_readme.py holds that list to the constants).
DOCUMENTED = {0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 64, 129, 130, 141, 143}
# What each command may answer here, whatever the conditions (the reason in each case's name).
COMMANDS = {
    "status": ["status"],
    "status --json": ["status", "--json"],
    "check": ["check"],
    "selftest": ["selftest"],
    "bundle": ["bundle", "/"],
    "env": ["env"],
}
UNDECODABLE = b"\xff\xfe"
# Under -I the interpreter reads no PYTHONPATH: npu_shim as if installed, by its own sys.path.
ISOLATED = ("import sys; sys.path[:0] = %r; from npu_shim.__main__ import run; sys.argv[0] = 'npu_shim'; "
            "sys.exit(run(sys.argv[1:]))")


@pytest.fixture
def place(tree, tmp_path):
    """The tree and a ``torch`` that is missing."""
    fake = tmp_path / "no-torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    return tree, tmp_path / "no-torch"


# What Python does in a UTF-8 locale such as en_US.UTF-8: stdout encodes strictly (C.UTF-8, a
# coercion target, gets surrogateescape instead, and so hides what a real locale shows).  Set by
# PYTHONIOENCODING here, as this machine kind has no en_US.UTF-8 (docs/reliability.md: checked by
# hand with one compiled by localedef).
STRICT_UTF8 = {"LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}

CONDITIONS = {
    "plain": ([], {}),
    "-O": (["-O"], {}),
    "-OO": (["-OO"], {}),
    "-S": (["-S"], {}),
    "-I": (["-I"], {}),
    "PYTHONSAFEPATH=1": ([], {"PYTHONSAFEPATH": "1"}),
    "PYTHONOPTIMIZE=2": ([], {"PYTHONOPTIMIZE": "2"}),
    "C locale": ([], {"LC_ALL": "C", "LANG": "C"}),
    "POSIX locale": ([], {"LC_ALL": "POSIX"}),
    "C.UTF-8 locale": ([], {"LC_ALL": "C.UTF-8"}),
    "a strict UTF-8 locale": ([], STRICT_UTF8),
    "bytes in a variable's name and value": ([], {**STRICT_UTF8, b"NPU_SHIM_X" + UNDECODABLE: b"1" + UNDECODABLE}),
    "bytes in a known variable's value": ([], dict(STRICT_UTF8, NPU_SHIM_PATCHES=b"zbal" + UNDECODABLE)),
}


def command_line(flags, args, place):
    tree, no_torch = place
    paths = [REPO, str(tree / "image"), str(tree / "pkgs"), str(no_torch)]
    if "-I" in flags:
        return [sys.executable] + flags + ["-c", ISOLATED % paths] + args
    return [sys.executable] + flags + ["-m", "npu_shim"] + args


def environment(extra, place):
    tree, no_torch = place
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON", "LC_"))}
    env.update({"PYTHONPATH": os.pathsep.join([REPO, str(tree / "image"), str(tree / "pkgs"), str(no_torch)]),
                "CHAIN_MARKER": str(tree / "marker"), "PYTHONDONTWRITEBYTECODE": "1"})
    env.update(extra)
    return env


def assert_kept(proc, what):
    out = proc.stdout or b""
    err = proc.stderr or b""
    assert proc.returncode in DOCUMENTED, (what, proc.returncode, err[-2000:])
    assert b"Traceback" not in err and b"Traceback" not in out, (what, err[-3000:])
    assert b"Error:" not in err or b"npu-shim" in err, (what, err[-2000:])


@pytest.mark.parametrize("condition", list(CONDITIONS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_answers_under_every_condition(command, condition, place):
    flags, extra = CONDITIONS[condition]
    argv = command_line(list(flags), COMMANDS[command], place)
    proc = subprocess.run(argv, env=environment(extra, place), cwd=str(place[0]),
                          capture_output=True, timeout=240)
    assert_kept(proc, (command, condition))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_with_stdout_closed(command, place):
    """Python gives None for a closed stdout: before the fix every write raised AttributeError."""
    argv = command_line([], COMMANDS[command], place)
    proc = subprocess.run(argv, env=environment({}, place), cwd=str(place[0]), stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=240,
                          preexec_fn=lambda: os.close(1))
    assert_kept(proc, command)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_whose_reader_goes_away(command, place):
    """``| head -c 1``: the reader closes the pipe after one byte; the command ends quietly (141 if
    it had more to write, else its own code)."""
    argv = command_line([], COMMANDS[command], place)
    proc = subprocess.Popen(argv, env=environment({}, place), cwd=str(place[0]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=240)
    proc.stdout = None
    proc.stderr = err
    assert_kept(proc, command)
    assert proc.returncode != 120  # Python's own code for a failed flush at exit


def test_status_shows_undecodable_names_escaped_under_a_utf8_locale(place):
    """Before the fix ``printable`` let lone surrogates through: UnicodeEncodeError, exit 1."""
    env = environment({**STRICT_UTF8, b"NPU_SHIM_X" + UNDECODABLE: b"1"}, place)
    proc = subprocess.run(command_line([], ["status"], place), env=env, cwd=str(place[0]),
                          capture_output=True, timeout=120)
    assert proc.returncode == exit_codes.EXIT_BAD_ENV, proc.stderr
    assert b"NPU_SHIM_X\\udcff\\udcfe" in proc.stdout and b"UNKNOWN" in proc.stdout


def test_check_shows_an_undecodable_sglang_path_escaped(place, tmp_path):
    """sglang in a folder whose name is no UTF-8: before the fix check's report line raised
    UnicodeEncodeError under a UTF-8 locale."""
    tree = place[0]
    odd = os.path.join(os.fsencode(str(tree)), b"pk" + UNDECODABLE)
    os.rename(str(tree / "pkgs"), odd)
    env = environment(STRICT_UTF8, place)
    env["PYTHONPATH"] = os.pathsep.encode().join([os.fsencode(REPO), os.fsencode(str(tree / "image")), odd])
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "check"], env=env, cwd=str(tree),
                          capture_output=True, timeout=120)
    assert b"Traceback" not in proc.stderr, proc.stderr
    assert b"pk\\udcff\\udcfe/sglang" in proc.stdout, proc.stdout
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "status"], env=env, cwd=str(tree),
                          capture_output=True, timeout=120)
    assert b"Traceback" not in proc.stderr and b"pk\\udcff\\udcfe/sglang" in proc.stdout, proc.stderr
