"""zbal asked for but not importable (tests/patches/test_zbal_real.py): the first sglang import
stops."""
from npu_shim.core.framework import ShimError
from shimdev import simnpu
from shimdev.programs import emit

try:
    import sglang.srt.utils  # noqa: F401 - the import is what is tried: its utils.common is the first target module
    emit({"error": None})
except ShimError as exc:
    import sys
    emit({"error": str(exc), "allocations": simnpu.STATE.npu_allocations,
          "scheduler_imported": "sglang.srt.managers.scheduler" in sys.modules})
