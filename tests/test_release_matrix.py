"""Static matrix: every supported sglang release, every patch, decided from the wheel's real source.

For each release the wheel is downloaded once (cached), its ``sglang/`` tree extracted, and each
patch is decided exactly as the runtime decides it (probe, then every target resolved with a known
signature), with the patch switched on and its trigger assumed set.  The expected table
(dev/shimdev/beds/expected_states.py) is the one docs/releases.md shows users; test_docs_table_matches
keeps the two identical.

Adding a release: one line in dev/shimdev/envs/releases.py RELEASES (or POST_RELEASES) and its row in
expected_states.py (``python3 scripts/release_report.py VERSION`` prints it), then
``python3 scripts/release_report.py --write-docs``.
"""

import os
import re

import pytest
from shimdev.envs import sglang_envs

from npu_shim.core import framework
from npu_shim.source.codeview import SourceView
from npu_shim.core.loading import load_all

from shimdev.beds.expected_states import DOC, EXPECTED, PATCH_ORDER, TABLE_END, TABLE_START, render_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def test_expected_table_covers_exactly_the_supported_releases():
    assert tuple(EXPECTED) == tuple(sglang_envs.ALL_RELEASES)
    assert set(sglang_envs.RELEASES) < set(EXPECTED)
    # every post release is a post release of a base release of the table, right after it
    for post in sglang_envs.POST_RELEASES:
        base = post.rsplit(".post", 1)[0]
        assert base in sglang_envs.RELEASES, post
        assert sglang_envs.version_key(base) < sglang_envs.version_key(post) < min(
            sglang_envs.version_key(v) for v in sglang_envs.RELEASES if sglang_envs.version_key(v) >
            sglang_envs.version_key(base)), post


def static_states(version):
    view = SourceView(os.path.join(str(sglang_envs.ensure_sources(version)), "sglang"))
    assert view.version == version, "wheel of %s reports version %s" % (version, view.version)
    states = {}
    for patch in load_all():
        decision = framework.decide(patch, view, environ={}, on_npu=None, assume_triggered=True)
        states[patch.name] = (decision.state, decision.reason)
    return states


@pytest.mark.parametrize("version", list(EXPECTED))
def test_release(version):
    """The decision from the release's source is what the patches' declarations promise."""
    states = static_states(version)
    assert tuple(states) == PATCH_ORDER
    got = {name: states[name][0] for name in PATCH_ORDER}
    assert got == EXPECTED[version], "\n".join(
        "%s: %s (%s)" % (name, state, reason) for name, (state, reason) in states.items())
    for name, (state, reason) in states.items():
        if state == "upstream":
            assert reason.startswith("sglang %s has it: " % version)


def docs_block():
    with open(os.path.join(REPO, DOC), encoding="utf-8") as handle:
        text = handle.read()
    assert text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1
    return text.split(TABLE_START)[1].split(TABLE_END)[0]


def docs_table():
    rows, header = {}, None
    for line in docs_block().strip().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "sglang":
            header = cells[1:]
        elif re.fullmatch(r"0\.5\.\d+(\.post\d+)?", cells[0]):
            rows[cells[0]] = dict(zip(header, cells[1:]))
    return rows


def test_docs_table_matches():
    assert docs_table() == EXPECTED
    # generated from the declarations: `python3 scripts/release_report.py --write-docs`
    assert docs_block().strip() == render_table()
    assert "Each cell: the patch switched on, its trigger set (`SGLANG_ZBAL_LOCAL_MEM_SIZE=" in docs_block()
