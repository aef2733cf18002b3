"""npu-shim: backports of Ascend-NPU optimisations onto already-built sglang images.

Put the repository on ``PYTHONPATH`` (its ``sitecustomize.py`` arms the shim in every process), or
call ``npu_shim.install()`` yourself.  Nothing heavy is imported here: this module is loaded at
interpreter start-up in every process of the image.
"""

__version__ = "0.2.2"


def install():
    """Arm the shim in this process (patching sglang modules already imported); False if it was."""
    from npu_shim import installer

    return installer.install()


def uninstall():
    """Restore every original function and rebound copy; the shim is then off in this process."""
    from npu_shim import installer

    installer.uninstall()


def states():
    """{patch name: {"state", "reason", "targets", "details"}} for this process."""
    from npu_shim import runtime

    return runtime.states()
