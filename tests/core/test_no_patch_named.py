"""The core, the commands, the runtime, the source reader and the operations code name no patch:
what a patch knows (its facts for ``check``, how its details read, its requirements) lives in its
module, so adding or removing one touches nothing else (docs/adding-a-patch.md) -- but the
registry (npu_shim/core/registry.py), the one list of their modules' names."""

import os
import re

from npu_shim.core.registry import known_names

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "npu_shim")
ROOMS = ("core", "reporting", "source", "runtime", "cli")
TOP = ("__init__.py", "__main__.py", "_bootstrap.py")
REGISTRY = os.path.join(PACKAGE, "core", "registry.py")


def files():
    for room in ROOMS:
        for folder, dirs, names in os.walk(os.path.join(PACKAGE, room)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            yield from (os.path.join(folder, n) for n in names
                        if n.endswith(".py") and os.path.join(folder, n) != REGISTRY)
    yield from (os.path.join(PACKAGE, name) for name in TOP)


def pattern_of(name):
    """How code names a patch: its name, in any case (also inside ``NPU_SHIM_<NAME>``), and its
    class-style CamelCase (``mla_weight_release``, ``MlaWeightRelease``).  Its words alone are not
    its name: a patch named ``memory_*`` or ``kernel_*`` must not make every use of those words
    fail."""
    camel = "".join(part.capitalize() for part in name.split("_"))
    return re.compile(r"(?<![A-Za-z0-9])((?i:%s)|%s)" % (re.escape(name), re.escape(camel)))


def test_the_check_is_of_names_not_words():
    pattern = pattern_of("memory_pool")
    assert pattern.search("NPU_SHIM_MEMORY_POOL=0") and pattern.search("class MemoryPoolState:")
    assert pattern.search("npu_shim/patches/memory_pool.py")
    assert not pattern.search("free device memory (MiB)") and not pattern.search("a memory pool")
    assert not pattern_of("kernel_cache").search("the kernel's cache")


def test_no_module_outside_the_patches_names_a_patch():
    assert os.path.isfile(REGISTRY) and REGISTRY not in set(files())  # the one module left out
    found = []
    for name in known_names():
        pattern = pattern_of(name)
        for path in files():
            with open(path, encoding="utf-8") as handle:
                for number, line in enumerate(handle, 1):
                    if pattern.search(line):
                        found.append("%s:%d: %s" % (os.path.relpath(path, PACKAGE), number, line.strip()))
    assert found == []
