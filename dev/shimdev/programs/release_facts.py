"""What a release process sees of its environment (tests/dev/test_release_envs.py): its path, wrapt,
sglang (and a child's), the versions, the shim; printed as one JSON line.  Run as ``-c`` runs code
(``sys.path[0]`` empty), through runpy."""
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys


def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


spec = importlib.util.find_spec("sglang")
child = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('sglang').origin)"],
                       stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
print(json.dumps({
    "path0": sys.path[0] if sys.path[0] else sys.path[1],
    "pythonpath": os.environ["PYTHONPATH"].split(os.pathsep),
    "wrapt_spec": bool(importlib.util.find_spec("wrapt")),
    "wrapt": version("wrapt"),
    "wrapt_file": getattr(importlib.util.find_spec("wrapt"), "origin", None),
    "sglang": spec.origin if spec else None, "child_sglang": child,
    "sglang_version": version("sglang"), "transformers": version("transformers"),
    "torch": version("torch"), "shim_file": importlib.util.find_spec("npu_shim").origin,
    "executable": sys.executable,
}))
