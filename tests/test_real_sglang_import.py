"""Import matrix: the real sglang modules of every release of the table (post releases included) and
of the editable install, executed on the simulated NPU with the shim on PYTHONPATH exactly as a
user has it.  One subprocess per release (dev/shimdev/beds/import_probe.py) does
everything:

* imports every module a patch targets, with every patch triggered (demo_features.DEMO_ENV: zbal
  size and bootstrap set, zbal importable (the wheel's Python layer, simulated native side),
  multi-stream on, the fused decode kernel
  present), so each reaches the state the expected table gives for that release;
* looks at the loaded modules themselves: which functions are wrapt wrappers (exactly the applied
  patches' targets), and whether the copies other modules took with ``from ... import`` are the
  wrapped ones;
* runs each applied feature's driver (dev/shimdev/beds/demo_features.py, shared with the demo; their
  set-ups, dev/shimdev/beds/release_beds.py, with the real-release tests) on the release's real code;
  import_probe.problems() checks what it measured.

A release whose layers cannot be built FAILS (never skips).
"""
from __future__ import annotations

import pytest

from shimdev.beds import import_probe
from shimdev.envs import realsglang
from shimdev.beds.expected_states import expected
from shimdev.envs import sglang_envs


def test_matrix_covers_every_release_and_the_editable_install():
    assert realsglang.IMPORT_MATRIX == sglang_envs.ALL_RELEASES + (realsglang.EDITABLE_VERSION,)
    assert set(sglang_envs.POST_RELEASES) <= set(realsglang.IMPORT_MATRIX)
    assert realsglang.table_release(realsglang.EDITABLE_VERSION) in sglang_envs.ALL_RELEASES
    assert ".dev" in realsglang.EDITABLE_VERSION


@pytest.mark.parametrize("version", realsglang.IMPORT_MATRIX)
def test_real_modules_import_and_are_patched_as_expected(version, release_venv):
    release_venv(version)  # build (or fail) before running the snippet
    out = import_probe.probe(version)
    table = expected(realsglang.table_release(version))
    assert import_probe.problems(version, out, table) == []
    # every applied feature's driver ran (problems() checked what each measured)
    assert sorted(out["drivers"]) == sorted(n for n, s in table.items() if s == "applied")
    if version == realsglang.EDITABLE_VERSION:
        # setuptools' editable finder (a meta-path finder), not a path entry, serves the source tree
        assert any(f.startswith("_EditableFinder") for f in out["finders"]), out["finders"]
        assert out["sglang_file"].endswith("/src/sglang/__init__.py"), out["sglang_file"]
    else:
        assert "/layered/sglang-%s/sglang/" % version in out["sglang_file"], out["sglang_file"]
