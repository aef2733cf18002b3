"""The core, the commands, the runtime, the source reader and the operations code name no patch:
what a patch knows (its facts for ``check``, how its details read, its requirements) lives in its
module, so adding or removing one touches nothing else (docs/adding-a-patch.md)."""

import os
import re

from npu_shim.patches.registry import known_names

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "npu_shim")
ROOMS = ("core", "ops", "source", "runtime", "cli")
TOP = ("__init__.py", "__main__.py", "_bootstrap.py")


def files():
    for room in ROOMS:
        for folder, dirs, names in os.walk(os.path.join(PACKAGE, room)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            yield from (os.path.join(folder, n) for n in names if n.endswith(".py"))
    yield from (os.path.join(PACKAGE, name) for name in TOP)


def words_of(name):
    """A patch's name and its words that name nothing else (``zbal``; ``mla``, ``dual_stream``)."""
    parts = name.split("_")
    return {name, parts[0]} | ({"_".join(parts[:2])} if len(parts) > 2 else set())


def test_no_module_outside_the_patches_names_a_patch():
    found = []
    for name in known_names():
        pattern = re.compile(r"(?<![A-Za-z])(%s)(?![A-Za-z])" % "|".join(map(re.escape, words_of(name))), re.I)
        for path in files():
            with open(path, encoding="utf-8") as handle:
                for number, line in enumerate(handle, 1):
                    if pattern.search(line):
                        found.append("%s:%d: %s" % (os.path.relpath(path, PACKAGE), number, line.strip()))
    assert found == []
