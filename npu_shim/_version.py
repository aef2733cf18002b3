"""The version of npu-shim (one place: setup.cfg, the log tag and every record read it)."""

__version__ = "0.2.2"
