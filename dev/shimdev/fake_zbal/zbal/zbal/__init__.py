"""Fake of the native extension ``zbal.zbal`` (a .so in the real wheel; signatures of its
functions cannot be read from the wheel, so these accept anything and record the call)."""
import enum

from .._fake import FAKE, recorded


class ZBALBootstrapType(enum.IntEnum):
    BOOT_BY_MEMFABRIC = 0
    BOOT_BY_BUTT = 1


class ZBALBootstrapOption:
    def __init__(self):
        self.flags = 0
        self.btType = ZBALBootstrapType.BOOT_BY_MEMFABRIC
        self.ipPort = ""
        self.worldSize = 0
        self.rankId = 0
        self.deviceId = 0
        self.startConfigServer = False
        self.deviceMemorySize = 0
        self.dataOperationType = 0
        self.commMetaSpaceSize = 0
        self.commGroupCap = 0


def zbal_version():
    return FAKE.version


@recorded
def zbal_bootstrap(opt):
    FAKE.initialized = bool(FAKE.init_result)
    FAKE.ip_port = opt.ipPort
    return 0 if FAKE.init_result else -1


@recorded
def zbal_unbootstrap(flags=0):
    FAKE.initialized = False
    return 0


@recorded
def zbal_comm_destroy_all(flags=0):
    return 0


@recorded
def zbal_set_logger_level(*args, **kwargs):
    return None


class ProcessGroupZBAL:
    """Stands in for the native c10d backend (no collective is simulated)."""

    class Options:
        def __init__(self):
            self.is_high_priority_stream = False
            self.op_timeout = None
            self.global_ranks_in_group = []
            self.group_id = ""

    def __init__(self, store, rank, size, options=None):
        self.store, self._rank, self._size, self.options = store, rank, size, options

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def get_zbal_comm_name(self):
        return f"zbal_comm_{self._rank}_{self._size}"

    def init_zbal_comm_meta(self):
        return None
