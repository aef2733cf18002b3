"""``python3 scripts/release_report.py VERSION``: fetch, decide from source, import with the shim on,
print the row to paste.  On the newest release on PyPI it must agree with the expected table."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from shimdev.beds.expected_states import EXPECTED, row
from shimdev.envs import sglang_envs

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "release_report.py"


def run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=str(REPO), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout)


def load_report():
    from shimdev.beds import release_report

    return release_report


def test_newest_release_on_pypi_agrees_with_the_table():
    p = run("latest")
    out = p.stdout
    assert p.returncode == 0, out[-4000:] + p.stderr[-2000:]
    newest = out.splitlines()[0].split()[1]
    # the table (and RELEASES) end with the newest release on PyPI
    assert newest == sglang_envs.RELEASES[-1] == list(EXPECTED)[-1], out[:500]
    assert ", in the expected table" in out.splitlines()[0]
    assert "   " + row(newest, EXPECTED[newest]) in out.splitlines()
    assert "agrees with the source decision" in out and "the table has" in out and "agrees" in out
    assert "DIFFERS" not in out and "DISAGREES" not in out


def test_what_moved_between_releases_is_named():
    mod = load_report()
    # 0.5.9 -> 0.5.10: upstream merged the dual-stream experts (the probe says so)
    lines = mod.moved(mod.release_view("0.5.9"), mod.release_view("0.5.10"))
    assert any(line.startswith("dual_stream_experts: the probe now says upstream: ") for line in lines), lines
    # 0.5.11 -> 0.5.12: zbal merged upstream
    lines = mod.moved(mod.release_view("0.5.11"), mod.release_view("0.5.12"))
    assert any(line.startswith("zbal: the probe now says upstream: ") for line in lines), lines
    # 0.5.8 -> 0.5.9: the dual-stream bodies are pinned by fingerprint and did not change
    lines = mod.moved(mod.release_view("0.5.8"), mod.release_view("0.5.9"))
    assert not [line for line in lines if line.startswith("dual_stream_experts")], lines
    # a post release changes nothing the shim reads
    assert mod.moved(mod.release_view("0.5.10"), mod.release_view("0.5.10.post1")) == []


def test_a_changed_pinned_body_is_reported(tmp_path):
    from npu_shim.source.codeview import SourceView

    mod = load_report()
    src = Path(str(sglang_envs.ensure_sources("0.5.9"))) / "sglang"
    copy = tmp_path / "sglang"
    shutil.copytree(src, copy)
    glm = copy / "srt" / "models" / "glm4_moe.py"
    text = glm.read_text()
    marker = "    def forward_deepep(\n"
    assert marker in text
    head, tail = text.split(marker, 1)
    body_start = tail.index(":\n") + 2
    tail = tail[:body_start] + "        hidden_states = hidden_states + 0\n" + tail[body_start:]
    glm.write_text(head + marker + tail)
    lines = mod.moved(mod.release_view("0.5.9"), SourceView(str(copy)))
    assert any("pinned body sglang.srt.models.glm4_moe:Glm4MoeSparseMoeBlock.forward_deepep changed" in line
               for line in lines), lines


def test_write_docs_is_a_no_op_on_current_docs():
    p = run("--write-docs", timeout=60)
    assert p.returncode == 0 and "already up to date" in p.stdout, p.stdout + p.stderr
