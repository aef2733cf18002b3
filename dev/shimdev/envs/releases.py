"""The sglang releases npu-shim supports (the expected table has one row per entry): the base
releases, their post releases, the editable install, and how their versions sort.  One line in
``RELEASES`` or ``POST_RELEASES`` supports one more (docs/releases.md)."""
from __future__ import annotations

import re

from shimdev.envs.buildcache import EnvError

#: Every supported base release, oldest first.  One line to add one.
RELEASES = (
    "0.5.7",
    "0.5.8",
    "0.5.9",
    "0.5.10",
    "0.5.11",
    "0.5.12",
    "0.5.13",
    "0.5.14",
    "0.5.15",
    "0.5.16",
    "0.5.17",
    "0.5.18",
    "0.5.19",
    "0.5.20",
    "0.5.21",
    "0.5.22",
    "0.5.23",
)

#: Every post release on PyPI of a supported base release (``pip index versions sglang``).
POST_RELEASES = (
    "0.5.8.post1",
    "0.5.10.post1",
    "0.5.12.post1",
    "0.5.13.post1",
    "0.5.15.post1",
)

_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?(?:\.dev(\d+))?(?:\+[\w.]+)?$")


def version_key(version: str) -> tuple:
    """Sort key of an sglang version: 0.5.10 < 0.5.10.post1 < 0.5.11; a .devN sorts before the
    release it leads to (PEP 440 for the forms sglang uses)."""
    m = _VERSION_RE.match(version)
    if not m:
        raise ValueError(f"not an sglang version: {version!r}")
    major, minor, micro, post, dev = m.groups()
    post_key = int(post) if post is not None else -1
    return (int(major), int(minor), int(micro), post_key, int(dev) if dev is not None else 1 << 30)


#: Every release the test bed knows, oldest first (the expected table has one row per entry).
ALL_RELEASES = tuple(sorted(RELEASES + POST_RELEASES, key=version_key))

#: The editable install (upstream's NPU image: ``pip install -e`` of a source tree, version from
#: setuptools-scm).  ``release``: the sdist whose tree is installed (PyPI has sdists up to
#: 0.5.10.post1); ``version``: the dev version setuptools-scm is made to give it (what a checkout
#: 3 commits after the 0.5.10.post1 tag reads).  Its expected states are those of ``release``.
EDITABLE = {"release": "0.5.10.post1", "version": "0.5.10.post2.dev3+g5d1c3a7"}


def check_release(version: str, strict: bool = True) -> None:
    """A release of the table (``strict``), or at least an sglang version string."""
    if strict and version not in ALL_RELEASES:
        raise EnvError(f"sglang {version!r} is not a supported release; supported: "
                       f"{', '.join(ALL_RELEASES)}")
    if not _VERSION_RE.match(version):
        raise EnvError(f"{version!r} is not an sglang version")
