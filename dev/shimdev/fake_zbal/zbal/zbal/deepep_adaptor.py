"""Fake of ``zbal.zbal.deepep_adaptor`` (native submodule): DeepEP's Config/EventHandle/Buffer."""
from .._fake import recorded


class Config:
    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=128):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def __repr__(self):
        return (f"Config({self.num_sms}, {self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}, {self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens})")

    def __eq__(self, other):
        return isinstance(other, Config) and vars(self) == vars(other)


class EventHandle:
    def current_stream_wait(self):
        return None


@recorded
def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
    return num_max_dispatch_tokens_per_rank * hidden * num_ranks * 2 * 2


class Buffer:
    """The native runtime behind zbal_buffer.Buffer; no kernel is simulated."""

    def __init__(self, rank, group_size, num_nvl_bytes, num_rdma_bytes, low_latency_mode, group_name):
        self.rank, self.group_size = rank, group_size
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.group_name = low_latency_mode, group_name

    def get_num_rdma_ranks(self):
        return 1

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def not_simulated(*args, **kwargs):
            raise NotImplementedError(f"fake zbal: deepep_adaptor.Buffer.{name} is not simulated")
        return not_simulated
