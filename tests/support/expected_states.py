"""What each patch does on each supported release, with the patch switched on and its trigger set.

The single expected table for the static matrix (tests/test_release_matrix.py, every release's
source), the import matrix (tests/test_real_sglang_import.py, real modules executed) and README.md.
"""

PATCH_ORDER = ("zbal", "mla_weight_release", "dual_stream_experts")

# release: states of (zbal, mla_weight_release, dual_stream_experts)
EXPECTED = {
    "0.5.7": ("applied", "unsupported", "applied"),
    "0.5.8": ("applied", "unsupported", "applied"),
    "0.5.9": ("applied", "applied", "applied"),
    "0.5.10": ("applied", "applied", "upstream"),
    "0.5.11": ("applied", "applied", "upstream"),
    "0.5.12": ("upstream", "applied", "upstream"),
    "0.5.13": ("upstream", "applied", "upstream"),
    "0.5.14": ("upstream", "applied", "upstream"),
    "0.5.15": ("upstream", "applied", "upstream"),
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
