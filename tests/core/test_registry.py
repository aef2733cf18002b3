"""The registry (npu_shim/core/registry.py ``PATCH_MODULES``), each feature module's own
declaration and docstring, and README's patch table say the same thing."""
from __future__ import annotations

import os
import re
import sys

from npu_shim.core import loading
from npu_shim.core import registry as patch_registry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCHES = os.path.join(REPO, "npu_shim", "patches")


def readme_patch_rows():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        text = handle.read()
    table = text.split("| patch | what it brings | upstream |")[1].split("\n\n")[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in table.strip().splitlines()[1:]]


def test_every_registered_module_is_a_patch_of_its_own_name():
    names = [m.rsplit(".", 1)[-1] for m in patch_registry.PATCH_MODULES]
    assert names == patch_registry.known_names()
    assert [p.name for p in loading.load_all()] == names
    here = sorted(f[:-3] for f in os.listdir(PATCHES) if f.endswith(".py") and f != "__init__.py")
    assert here == sorted(names), "a feature module that is not registered (or the reverse)"


def test_every_module_of_selftest_is_a_patch_s_or_a_helper_no_patch_can_be_named():
    """``_selftest/<name>`` is found from a patch's name: a module there is a registered patch's,
    or a helper whose name begins with ``_`` (no patch's name can:
    ``core.framework.declaration_problems``), so a patch registered later never gets a helper as
    its selftest step.  A patch is one module: no other folder holds a part of one."""
    names = set(patch_registry.known_names())
    found = sorted(f[:-3] for f in os.listdir(os.path.join(PATCHES, "_selftest"))
                   if f.endswith(".py") and f != "__init__.py")
    assert [f for f in found if f not in names and not f.startswith("_")] == []
    folders = sorted(d for d in os.listdir(PATCHES) if os.path.isdir(os.path.join(PATCHES, d)) and d != "__pycache__")
    assert folders == ["_selftest"]


def test_readme_has_one_row_per_patch_with_its_upstream():
    rows = readme_patch_rows()
    patches = loading.load_all()
    assert [row[0] for row in rows] == ["`%s`" % p.name for p in patches]
    for row, patch in zip(rows, patches):
        number = patch.upstream.pr.split("#")[1]
        assert row[2] == "sglang#%s, %s" % (number, patch.upstream.release), row


def test_each_module_says_why_how_upstream_and_when_to_remove_it():
    for patch in loading.load_all():
        doc = sys.modules[type(patch).__module__].__doc__
        for word in ("Why", "How", "Upstream: " + patch.upstream.pr, "Remove when " + patch.upstream.remove_when):
            assert word in doc, (patch.name, word)
        assert re.search(r"\b%s\b" % re.escape(patch.upstream.release), doc)
        assert patch.title and "\n" not in patch.title, patch.name  # the docstring's first line


def test_registry_loads_no_feature_module_until_asked():
    import subprocess

    code = ("import sys; from npu_shim.core.registry import known_names; known_names(); "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] == ['npu_shim', 'patches']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.stdout.strip() == "[]", out.stderr
