"""zbal backport (work in progress: minimal placeholder so the registry loads)."""

from npu_shim import config
from npu_shim.patching import Patch


class ZbalPatch(Patch):
    name = "zbal"
    title = "memfabric zbal allocator (backport of sglang 0.5.12)"
    upstream_pr = "sglang 0.5.12"
    upstream_release = "0.5.12"
    backport_range = "0.5.7 - 0.5.11"
    remove_when = "every supported image runs sglang >= 0.5.12"
    switch = config.ZBAL
    reads = (config.ZBAL_LOCAL_MEM_SIZE, config.ZBAL_BOOTSTRAP_URL)
    modules = ()

    def probe(self, view):
        return None

    def trigger(self, environ):
        return "SGLANG_ZBAL_LOCAL_MEM_SIZE is not set (placeholder)"

    def targets(self, view):
        return []


PATCH = ZbalPatch()
