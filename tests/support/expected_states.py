"""What each patch does on each supported release, with the patch switched on and its trigger set.

The single expected table for the static matrix (tests/test_release_matrix.py, every release's
source), the import matrix (tests/test_real_sglang_import.py, real modules executed) and README.md
(its supported-release table is ``render_table()``; ``python3 scripts/release_report.py
--write-readme`` writes it, tests/test_release_matrix.py checks it).  One row per release on PyPI
from 0.5.7 on, post releases included; ``scripts/release_report.py VERSION`` prints the row of a
new release.
"""

PATCH_ORDER = ("zbal", "mla_weight_release", "dual_stream_experts")

# release: states of (zbal, mla_weight_release, dual_stream_experts)
EXPECTED = {
    "0.5.7": ("applied", "inactive", "applied"),
    "0.5.8": ("applied", "inactive", "applied"),
    "0.5.8.post1": ("applied", "inactive", "applied"),
    "0.5.9": ("applied", "applied", "applied"),
    "0.5.10": ("applied", "applied", "upstream"),
    "0.5.10.post1": ("applied", "applied", "upstream"),
    "0.5.11": ("applied", "applied", "upstream"),
    "0.5.12": ("upstream", "applied", "upstream"),
    "0.5.12.post1": ("upstream", "applied", "upstream"),
    "0.5.13": ("upstream", "applied", "upstream"),
    "0.5.13.post1": ("upstream", "applied", "upstream"),
    "0.5.14": ("upstream", "applied", "upstream"),
    "0.5.15": ("upstream", "applied", "upstream"),
    "0.5.15.post1": ("upstream", "applied", "upstream"),
    "0.5.16": ("upstream", "applied", "upstream"),
    "0.5.17": ("upstream", "applied", "upstream"),
    "0.5.18": ("upstream", "applied", "upstream"),
    "0.5.19": ("upstream", "applied", "upstream"),
    "0.5.20": ("upstream", "upstream", "upstream"),
    "0.5.21": ("upstream", "upstream", "upstream"),
    "0.5.22": ("upstream", "upstream", "upstream"),
    "0.5.23": ("upstream", "upstream", "upstream"),
}


def expected(version):
    """{patch name: state} for one release."""
    return dict(zip(PATCH_ORDER, EXPECTED[version]))


def row(version, states):
    """One line of EXPECTED, as it is written above (what release_report.py prints to paste)."""
    return '    "%s": (%s),' % (version, ", ".join('"%s"' % states[name] for name in PATCH_ORDER))


README_START, README_END = "<!-- release-table -->", "<!-- /release-table -->"


def render_table():
    """README.md's supported-release table (between README_START and README_END)."""
    lines = ["| sglang | %s |" % " | ".join(PATCH_ORDER), "|---|---|---|---|"]
    lines += ["| %s | %s |" % (version, " | ".join(states)) for version, states in EXPECTED.items()]
    return "\n".join(lines)
