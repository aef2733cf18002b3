"""simzbal: the native half of memfabric-zbal 1.2.0, simulated; its Python half is the real one.

``import zbal`` in the tests loads the wheel's own ``__init__.py``, ``zbal_module.py``,
``zbal_buffer.py`` and ``zbal_utils.py``, unmodified, from the zbal layer the test command builds
(``npu_layers.ensure_zbal_layer``).  Next to them lies ``zbal.cpython-311-x86_64-linux-gnu.so``,
compiled from ``zbal_native.c`` here: Python imports it as the extension module ``zbal.zbal``, and
``zbal_module.py`` and torch_npu's ``NPUPluggableAllocator`` open it with ctypes and look up the
``zbal_pluggable_*`` symbols in it, as on a device.  What cannot run without CANN is simulated:

* the extension module's contents (``native.py``): bootstrap, heap statistics, mix mode, the DeepEP
  adaptor's ``Config`` / ``Buffer`` (no kernel runs) and the ``ProcessGroupZBAL`` backend class;
* memfabric itself: zbal reads its library path from ``MEMFABRIC_HYBRID_LIBRARY_PATH`` (the release
  environments point it at an empty directory of the layer) and only the native side would load it.

Test knobs (``STATE``): ``init_result`` (what bootstrap reports), ``mix`` (``is_mix_alloc()``),
``heap_total`` / ``heap_free`` (bytes, behind ``zbal.mem_get_info()``), ``version``; what happened:
``initialized``, ``ip_port``, and the graph pools torch_npu's capture hooks opened (``pools``: each
pool id's ``source`` -- ``gva_heap`` or ``device``, routed as the real library routes it -- the
``bytes`` its captures placed and still held at their end, whether it was ``released``;
``recording``; ``pool_errors``).  The hooks exist only where ``ZBAL_ENABLE_GRAPH=1`` made
``switch_to_allocator`` install them; ``HOOK_TYPES`` are the ctypes prototypes of torch_npu's call.
``CALLS`` lists every native call as ``(name, {field: value})``; the
same goes to ``simnpu.EVENTS`` as ``("zbal", name, fields)``.  ``bootstraps()`` gives each
bootstrap in ``zbal_init``'s own parameter names (``zbal_init`` is the wheel's code: what it passed
on is what the test can see).
"""
from __future__ import annotations

GiB = 1 << 30

#: Every call into the simulated native module, in order.
CALLS: list = []

#: ZBALBootstrapOption field -> the zbal_init parameter zbal_module.py fills it from.
BOOTSTRAP_FIELDS = {"worldSize": "world_size", "deviceId": "device_id", "rankId": "rank_id",
                    "deviceMemorySize": "device_mem_size", "ipPort": "ip_port", "flags": "flags",
                    "btType": "bootstrap_type", "startConfigServer": "start_config_server",
                    "dataOperationType": "data_op_type", "commMetaSpaceSize": "comm_meta_space_size",
                    "commGroupCap": "comm_group_cap"}


def _hook_types():
    import ctypes

    class MempoolId(ctypes.Structure):  # c10_npu::MempoolId_t, std::pair<uint64, uint64>
        _fields_ = [("first", ctypes.c_ulonglong), ("second", ctypes.c_ulonglong)]

    return {"MempoolId": MempoolId,
            "begin": ctypes.CFUNCTYPE(None, ctypes.c_int, MempoolId, ctypes.c_void_p),
            "end": ctypes.CFUNCTYPE(None, ctypes.c_int, MempoolId),
            "release": ctypes.CFUNCTYPE(None, ctypes.c_int, MempoolId)}


#: How torch_npu calls the three pool hooks (Module.cpp casts each address to these types): build
#: one from the address ``set_begin_allocate_to_pool`` etc. were given and call it.
HOOK_TYPES = _hook_types()


class _State:
    def __init__(self):
        self.reset()

    def reset(self):
        import os

        self.init_result = True
        # How the real library is told to run in mix mode is not readable here (its native
        # side reads ZBAL_NPU_ALLOC_CONF, syntax unknown): the simulation's own switch.
        self.mix = os.environ.get("SIMZBAL_MIX") == "1"
        self.heap_total = 60 * GiB
        self.heap_free = 60 * GiB
        self.version = "1.2.0"
        self.initialized = False
        self.ip_port = None
        # the graph pools (native.pool_*): {pool id: {"source", "captures", "bytes", "released"}},
        # the pool each device records to now, and what a real allocator would have refused
        self.pools = {}
        self.recording = {}
        self.pool_errors = []
        CALLS.clear()


STATE = _State()


def reset():
    """Restore STATE's knobs and clear CALLS (the torch.distributed backend stays registered)."""
    STATE.reset()


def record(name, fields=None):
    from shimdev.simnpu import log

    fields = dict(fields or {})
    CALLS.append((name, fields))
    log("zbal", name, fields)


def calls(name=None):
    return [c for c in CALLS if name is None or c[0] == name]


def bootstraps():
    """Each ``zbal_bootstrap`` as the ``zbal_init`` arguments it carries (``ip_port`` as zbal
    derived it when none was given)."""
    return [{BOOTSTRAP_FIELDS[k]: v for k, v in fields.items()} for _, fields in calls("zbal_bootstrap")]
