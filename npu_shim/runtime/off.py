"""The shim switched off (``NPU_SHIM_ENABLED=0``): what the start-up watcher says when it sees
``import sglang`` -- one line (no metrics: the shim hooks nothing in this process)."""

import os

from npu_shim.core import config
from npu_shim.reporting import log, procinfo
from npu_shim.source.reading import find_package_dir, read_version


def say_off():
    """One INFO line; never raises."""
    try:
        package_dir = find_package_dir("sglang")
        if package_dir:
            procinfo.note_sglang_version(read_version(package_dir))
        log.info("off (%s=%s): sglang is not patched in this process"
                 % (config.ENABLED.name, os.environ.get(config.ENABLED.name, "").strip()),
                 fields={"event": "off"})
    except Exception as exc:  # noqa: BLE001 - inside an import hook: never break the application's import
        try:
            log.error_once("off", "shim off; could not say more: %r" % (exc,))
        except Exception:  # noqa: BLE001 - saying so failed too: the import goes on, silent
            pass
