"""What a release process reports in the drop-in tests (tests/test_drop_in_real.py): every module a
patch targets imported, then each patch's state, the wrappers, and where wrapt came from.  Lives in
tests/support (on the release processes' PYTHONPATH) so a spawned child can import it too."""

import importlib
import os
import sys


def import_targets():
    """Import every module any patch targets (one a release does not have is skipped)."""
    from npu_shim.patches import load_all

    for name in sorted({m for patch in load_all() for m in patch.modules}):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not (exc.name and name.startswith(exc.name)):
                raise


def report():
    import npu_shim
    from npu_shim import wrapt_loader

    import_targets()
    states = npu_shim.states()
    origin = wrapt_loader.loaded_origin()
    return {"states": {k: v["state"] for k, v in states.items()},
            "reasons": {k: v["reason"] for k, v in states.items()},
            "wrappers": sorted(w for v in states.values() for w in v["wrappers"]),
            "origin": origin.as_dict() if origin else None,
            "app_wrapt": getattr(sys.modules.get("wrapt"), "__version__", None)}


def spawned_child(queue):
    """A multiprocessing spawn target: the simulated NPU first, as the parent had it."""
    import simnpu

    simnpu.install(release=os.environ["CHILD_RELEASE"])
    out = report()
    queue.put([out["states"], out["origin"]["source"] if out["origin"] else None])
