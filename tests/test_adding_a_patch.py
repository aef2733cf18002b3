"""docs/adding-a-patch.md's template is code that works: its two modules, taken from the page,
make a fourth patch in a copy of the shim that decides, applies and reverts in a process that
imports sglang, and shows in ``status``, ``check`` and the generated tables."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from test_bootstrap import write_fake_sglang

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(REPO, "docs", "adding-a-patch.md")
NAME = "example_backport"
TEMPLATE = re.compile(r"<!-- template: (?P<path>patches/[\w/.]+) -->\n```python\n(?P<code>.*?)```", re.S)


def template():
    """{path in the repository: code} of the guide's template blocks (named there from npu_shim/)."""
    with open(GUIDE, encoding="utf-8") as handle:
        return {"npu_shim/" + m.group("path"): m.group("code") for m in TEMPLATE.finditer(handle.read())}


def test_the_guide_holds_the_two_modules_of_one_patch():
    assert sorted(template()) == sorted(["npu_shim/patches/%s.py" % NAME, "npu_shim/patches/_selftest/%s.py" % NAME])


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """tmp/shim: a copy of the shim with the template's patch registered; tmp/pkgs: a minimal sglang."""
    root = tmp_path_factory.mktemp("fourth-patch")
    shim = root / "shim"
    shutil.copytree(os.path.join(REPO, "npu_shim"), shim / "npu_shim",
                    ignore=shutil.ignore_patterns("__pycache__", "_vendor"))
    shutil.copy(os.path.join(REPO, "npu_shim", "_bootstrap.py"), shim / "sitecustomize.py")
    for path, code in template().items():
        (shim / path).write_text(code)
    registry = shim / "npu_shim" / "core" / "registry.py"
    text = registry.read_text()
    registry.write_text(text.replace('"npu_shim.patches.dual_stream_experts",\n',
                                     '"npu_shim.patches.dual_stream_experts",\n    "npu_shim.patches.%s",\n' % NAME))
    write_fake_sglang(root / "pkgs")
    return root


def run(tree, args, extra_env=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tree / "shim"), str(tree / "pkgs"), os.path.join(REPO, "dev")]),
               SGLANG_EXAMPLE_EXTRA_MIB="24", **(extra_env or {}))
    return subprocess.run([sys.executable] + args, env=env, cwd=str(tree), capture_output=True, text=True,
                          timeout=300)


def test_the_fourth_patch_decides_applies_and_reverts(tree):
    code = textwrap.dedent("""
        import json
        from shimdev import simnpu
        simnpu.install()
        import npu_shim
        from sglang.srt.utils import common
        wrapped = common.get_npu_memory_capacity()
        state = npu_shim.states()["%s"]
        npu_shim.uninstall()
        print(json.dumps({"wrapped": wrapped, "state": state["state"], "wrappers": state["wrappers"],
                          "calls": state["details"]["calls"], "after": common.get_npu_memory_capacity(),
                          "states": npu_shim.states()}))
    """ % NAME)
    proc = run(tree, ["-c", code])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"wrapped": 1024, "state": "applied", "wrappers": ["sglang.srt.utils.common:get_npu_memory_capacity"],
                   "calls": 1, "after": 1000, "states": {}}
    assert "%s=applied(1 calls)" % NAME not in proc.stderr  # said when decided: no call yet
    assert re.search(r"%s=applied\b" % NAME, proc.stderr), proc.stderr


def test_the_fourth_patch_shows_in_status_and_check(tree):
    status = run(tree, ["-m", "npu_shim", "status", "--json"])
    rows = {row["name"]: row for row in json.loads(status.stdout)["patches"]}
    assert rows[NAME]["state"] == "applied" and rows[NAME]["switch"] == "NPU_SHIM_EXAMPLE_BACKPORT"
    assert rows[NAME]["title"] == "Example backport: the capacity query reports extra memory"  # the docstring's
    assert (rows[NAME]["upstream"], rows[NAME]["backport_range"], rows[NAME]["remove_when"]) == (
        "backport of sgl-project/sglang#99999; upstream since 0.5.99", ["0.5.0", "0.5.98"],
        "every supported image runs sglang >= 0.5.99")
    env = {row["name"] for row in json.loads(status.stdout)["env"]}
    assert {"NPU_SHIM_EXAMPLE_BACKPORT", "SGLANG_EXAMPLE_EXTRA_MIB"} <= env
    off = run(tree, ["-m", "npu_shim", "status", "--json"], {"NPU_SHIM_EXAMPLE_BACKPORT": "0"})
    rows = {row["name"]: row for row in json.loads(off.stdout)["patches"]}
    assert rows[NAME]["state"] == "disabled"
    check = run(tree, ["-m", "npu_shim", "check", "--json"])
    report = json.loads(check.stdout)
    assert NAME in report["states"] and report["imports"]["sglang.srt.utils.common"] == "ok", check.stdout


def test_the_fourth_patch_shows_in_the_generated_tables(tree):
    code = textwrap.dedent("""
        import json
        from shimdev.beds import expected_states, release_report
        print(json.dumps({"releases": expected_states.render_table(), "env": release_report.env_table()}))
    """)
    proc = run(tree, ["-c", code])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    header = [line for line in out["releases"].splitlines() if line.startswith("| sglang |")][0]
    assert header.endswith("| %s |" % NAME)
    assert "| 0.5.11 | applied | applied | upstream | applied |" in out["releases"]
    assert "`NPU_SHIM_EXAMPLE_BACKPORT`" in out["env"] and "`SGLANG_EXAMPLE_EXTRA_MIB`" in out["env"]
