"""npu-shim: backports of Ascend-NPU optimisations onto already-built sglang images.

Put the repository on ``PYTHONPATH`` (its ``sitecustomize.py`` arms the shim in every process), or
call ``npu_shim.install()`` yourself.  Nothing heavy is imported here: this module is loaded at
interpreter start-up in every process of the image.
"""

from npu_shim._version import __version__  # noqa: F401 - npu_shim.__version__, the package's version


def install():
    """Arm the shim in this process (patching sglang modules already imported); False if it was."""
    from npu_shim import _bootstrap
    from npu_shim.runtime import activation, installer

    if not activation.RUNTIME.install(_bootstrap.WATCHER):
        return False
    installer.reach_children()
    return True


def uninstall():
    """Restore every original function and rebound copy; the shim is then off in this process."""
    from npu_shim import _bootstrap
    from npu_shim.runtime import activation

    activation.RUNTIME.uninstall(_bootstrap.WATCHER)


def states():
    """{patch name: {"state", "reason", "targets", "details"}} for this process."""
    from npu_shim.runtime import activation

    return activation.RUNTIME.states()
