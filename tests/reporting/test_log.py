"""The shim's log lines (npu_shim/reporting/log.py) stay one line each, whatever sglang's files or the
environment hold: nothing a local user can write reaches the operator's terminal raw."""

import json
import os
import re
import subprocess
import sys

from test_bootstrap import REPO, run, tree  # noqa: F401 - ``tree`` is a fixture

import npu_shim

RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202e]")


def test_a_version_literal_with_a_newline_cannot_forge_a_second_line(tree):
    (tree / "pkgs" / "sglang" / "version.py").write_text(
        '__version__ = "0.5.9\\\n[npu-shim 9.9.9 sglang 0.5.9 pid 1] demo=applied"\n')
    proc = run(tree, "import sglang.srt.utils")
    lines = proc.stderr.splitlines()
    assert lines and all(line.startswith("[npu-shim %s " % npu_shim.__version__) for line in lines), lines
    assert not any("9.9.9" in line and line.startswith("[npu-shim 9.9.9") for line in lines)


def test_escape_and_unknown_names_from_the_environment_are_escaped(tree):
    proc = run(tree, "import sglang.srt.utils", env={"NPU_SHIM_STRICT": "rel\x1b[2J", "NPU_SHIM_X\x1b]0;t\x07": "1"})
    assert not RAW_CONTROL.search(proc.stderr), repr(proc.stderr)
    assert "NPU_SHIM_STRICT='rel\\x1b[2J' is invalid" in proc.stderr
    assert "NPU_SHIM_X\\x1b]0;t\\x07" in proc.stderr


def test_json_lines_stay_one_object_each(tree):
    proc = run(tree, "import sglang.srt.utils", env={"NPU_SHIM_LOG_FORMAT": "json",
                                                     "NPU_SHIM_STRICT": "rel\nx\x1b"})
    for line in proc.stderr.strip().splitlines():
        assert isinstance(json.loads(line), dict)


def test_status_escapes_what_it_prints(tree):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_SHIM_")}
    env.update({"PYTHONPATH": os.pathsep.join([REPO, str(tree / "pkgs")]), "NPU_SHIM_Y\x1b[31m": "1"})
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "status"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 2
    assert not RAW_CONTROL.search(proc.stdout), repr(proc.stdout)
    assert "NPU_SHIM_Y\\x1b[31m" in proc.stdout
