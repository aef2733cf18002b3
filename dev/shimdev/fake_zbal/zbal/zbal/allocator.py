"""Fake of ``zbal.zbal.allocator`` (native submodule)."""
from .._fake import FAKE, recorded


def get_heap_stats():
    """(used_bytes, total_bytes) of the zbal heap."""
    return FAKE.heap_total - FAKE.heap_free, FAKE.heap_total


@recorded
def is_mix_alloc():
    return bool(FAKE.mix)


@recorded
def simulate_init(*args, **kwargs):
    return None


@recorded
def record_memory_history(*args, **kwargs):
    return None


@recorded
def dump_snapshot(*args, **kwargs):
    return None
