"""What a release process reports in the drop-in tests (tests/test_drop_in_real.py): every module a
patch targets imported, then each patch's state, the wrappers, and where wrapt came from.  Lives in
shimdev (dev/ is on the release processes' PYTHONPATH) so a spawned child can import it too."""

import os
import sys


def import_targets():
    """Import every module any patch targets as ``check`` does (one a release does not have is
    skipped); any other failure fails the probe."""
    from npu_shim.cli.check import import_target_modules

    failed = {name: how for name, how in import_target_modules().items() if how not in ("ok", "absent")}
    if failed:
        raise AssertionError("target modules failed to import: %s" % failed)


def report():
    import npu_shim
    from npu_shim.runtime import wrapt_loader

    import_targets()
    states = npu_shim.states()
    origin = wrapt_loader.loaded_origin()
    try:
        import wrapt  # what the application gets: the image's, untouched by the shim's private copy

        app_wrapt = wrapt.__version__
    except ImportError:
        app_wrapt = None
    return {"states": {k: v["state"] for k, v in states.items()},
            "reasons": {k: v["reason"] for k, v in states.items()},
            "wrappers": sorted(w for v in states.values() for w in v["wrappers"]),
            "origin": origin.as_dict() if origin else None,
            "app_wrapt": app_wrapt,
            "private_c_ext": wrapt_loader.PRIVATE_NAME + "._wrappers" in sys.modules}


def spawned_child(queue):
    """A multiprocessing spawn target: the simulated NPU first, as the parent had it."""
    from shimdev import simnpu

    simnpu.install(release=os.environ["CHILD_RELEASE"])
    out = report()
    queue.put([out["states"], out["origin"]["source"] if out["origin"] else None])
