"""Fake of zbal/zbal_module.py (memfabric-zbal 1.2.0): same names and signatures; the calls are
recorded (zbal.CALLS, simnpu.EVENTS) and driven by zbal.FAKE.  Sizes are in bytes."""
import ctypes  # noqa: F401 - mirrors the real module's names
from pathlib import Path
import os
import torch
import torch_npu
import torch.distributed as dist
from torch.distributed import ReduceOp  # noqa: F401
from zbal.zbal import ZBALBootstrapType, ZBALBootstrapOption
from zbal.zbal import zbal_version, zbal_bootstrap, zbal_unbootstrap, zbal_comm_destroy_all
from zbal.zbal.allocator import get_heap_stats

from ._fake import FAKE, recorded

CURRENT_DIR = Path(__file__).resolve().parent
ZBAL_LIB = CURRENT_DIR / "zbal.cpython-311-x86_64-linux-gnu.so"  # never loaded by the fake
ZBAL_ENABLE_GRAPH = int(os.environ.get("ZBAL_ENABLE_GRAPH", 0)) == 1

__version__ = zbal_version()


@recorded
def zbal_init(world_size: int,
              device_id: int,
              rank_id: int,
              device_mem_size: int,
              bootstrap_type: ZBALBootstrapType = ZBALBootstrapType.BOOT_BY_MEMFABRIC,
              start_config_server: bool = False,
              data_op_type: int = 0,
              comm_meta_space_size: int = 1024,
              comm_group_cap: int = 64,
              flags: int = 0,
              ip_port: str = ""):
    """Like the real one: switch the allocator if still native, set_device, bootstrap; bool."""
    mem_fabric_lib_path = os.environ.get("MEMFABRIC_HYBRID_LIBRARY_PATH")
    if mem_fabric_lib_path is None:
        if FAKE.memfabric_lib_path is None:
            raise ModuleNotFoundError("No module named 'memfabric_hybrid'", name="memfabric_hybrid")
        os.environ["MEMFABRIC_HYBRID_LIBRARY_PATH"] = FAKE.memfabric_lib_path

    if torch.npu.memory.get_allocator_backend() == 'native':
        switch_to_allocator()
    torch.npu.set_device(device_id)
    if ip_port == "":
        bootstrap_svr_ip = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        bootstrap_svr_port = "6789"
        master_port_str = os.environ.get("MASTER_PORT")
        if master_port_str is not None:
            try:
                bootstrap_svr_port = str(int(master_port_str) - 20)
            except ValueError:
                bootstrap_svr_port = "6789"
        ip_port = "tcp://" + bootstrap_svr_ip + ":" + bootstrap_svr_port

    opt = ZBALBootstrapOption()
    opt.flags = flags
    opt.btType = bootstrap_type
    opt.ipPort = ip_port
    opt.worldSize = world_size
    opt.rankId = rank_id
    opt.deviceId = device_id
    opt.startConfigServer = start_config_server
    opt.deviceMemorySize = device_mem_size
    opt.dataOperationType = data_op_type
    opt.commMetaSpaceSize = comm_meta_space_size
    opt.commGroupCap = comm_group_cap
    ret = zbal_bootstrap(opt)
    if dist.is_available() and dist.is_initialized() and dist.group.WORLD is not None:
        dist.barrier(group=dist.group.WORLD)
    return ret == 0


@recorded
def zbal_uninit(flags: int = 0):
    zbal_comm_destroy_all(flags)
    zbal_unbootstrap(flags)
    return True


@recorded
def switch_to_allocator():
    """Installs zbal as torch_npu's pluggable allocator (through the simnpu torch_npu stub)."""
    new_alloc = torch_npu.npu.memory.NPUPluggableAllocator(ZBAL_LIB,
                                                           "zbal_pluggable_malloc", "zbal_pluggable_free")
    torch_npu.npu.memory.change_current_allocator(new_alloc)


@recorded
def zbal_get_symm_base_addr():
    return 0


@recorded
def mem_get_info():
    """(free_bytes, total_bytes) of the zbal heap: zbal.FAKE.heap_free / heap_total."""
    return get_heap_stats()[1] - get_heap_stats()[0], get_heap_stats()[1]
