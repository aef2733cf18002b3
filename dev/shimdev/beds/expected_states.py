"""What each patch does on each supported release, derived from its declaration.

A patch declares ``upstream = Upstream(pr, release, backports=(first, last))``
(npu_shim/core/framework.py); ``framework.expected_state`` turns it into the state the patch must
reach on a release with its switch on and its trigger set (``TRIGGERS``): ``inactive`` before the
backports (nothing to backport onto), ``applied`` in them, ``upstream`` from ``release``.  The
static matrix (tests/test_release_matrix.py, every release's source), the import matrix
(tests/test_real_sglang_import.py, real modules executed) and docs/releases.md's supported-release
table (``render_table()``, written by ``python3 scripts/release_report.py --write-docs``) all check
the real decisions against this, so a declaration that is wrong about the code fails a test, and a
new patch needs no row anywhere (only its entry in ``TRIGGERS`` where a variable turns it on).
"""

from shimdev.envs import realsglang
from npu_shim.core.framework import expected_state
from npu_shim.core.loading import load_all

#: The variables that turn each patch on in a job, by patch name: what every cell of the table
#: assumes, and what the demo's release processes (dev/shimdev/beds/demo_features.py) and the
#: import matrix set.  A patch on by default (mla_weight_release: the disaggregation role decides
#: in the server) has no entry.
TRIGGERS = {
    "zbal": {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "12288"},
    "dual_stream_experts": {"SGLANG_NPU_USE_MULTI_STREAM": "1"},
}

PATCHES = load_all()
PATCH_ORDER = tuple(p.name for p in PATCHES)
RELEASES = realsglang.sglang_envs.ALL_RELEASES


def expected(version):
    """{patch name: state} for one release (any version, listed or not)."""
    return {p.name: expected_state(p, version) for p in PATCHES}


EXPECTED = {version: expected(version) for version in RELEASES}


def row(version, states):
    """One line of the supported-release table (what release_report.py prints)."""
    return "| %s | %s |" % (version, " | ".join(states[name] for name in PATCH_ORDER))


def assumptions():
    """What every cell of the table assumes, from the patches' declarations."""
    triggers = ", ".join("`%s=%s`" % kv for p in PATCHES for kv in sorted(TRIGGERS.get(p.name, {}).items()))
    return ("Each cell: the patch switched on, its trigger set (%s), on an NPU, with memfabric-zbal and "
            "sgl-kernel-npu's fused kernel installed. `inactive` there means the release has nothing "
            "for the patch to do; in a real job any patch can also read `disabled` or `inactive` "
            "(trigger unset, no NPU) -- `python -m npu_shim status` says which." % triggers)


DOC = "docs/releases.md"  # the page that shows the table, relative to the repository
TABLE_START, TABLE_END = "<!-- release-table -->", "<!-- /release-table -->"


def render_table():
    """DOC's supported-release table (between TABLE_START and TABLE_END)."""
    lines = [assumptions(), "", "| sglang | %s |" % " | ".join(PATCH_ORDER),
             "|---|%s" % ("---|" * len(PATCH_ORDER))]
    lines += [row(version, states) for version, states in EXPECTED.items()]
    return "\n".join(lines)
