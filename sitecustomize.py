"""npu-shim bootstrap: Python runs this at start-up when the repository is on PYTHONPATH.

It arms a watcher for ``import sglang`` (nothing heavier than ``sys``/``os`` is loaded here), then
runs the image's own ``sitecustomize`` -- the next one on ``sys.path`` -- exactly once.  Nothing
raised in here reaches the application.
"""


def _npu_shim_bootstrap():
    try:
        from npu_shim import _bootstrap
    except Exception as exc:  # noqa: BLE001 - start-up must never fail because of the shim
        import sys

        sys.stderr.write("[npu-shim] shim off: cannot import npu_shim: %r\n" % (exc,))
        return
    _bootstrap.start()
    try:
        _bootstrap.chain_next_sitecustomize(__file__)
    except Exception as exc:  # noqa: BLE001
        import sys

        sys.stderr.write("[npu-shim] could not run the next sitecustomize: %r\n" % (exc,))


_npu_shim_bootstrap()
del _npu_shim_bootstrap
