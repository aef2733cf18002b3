"""Fake of zbal/zbal_utils.py."""
from typing import Optional, Tuple

import torch
import torch_npu  # noqa: F401
from zbal.zbal.deepep_adaptor import Config, EventHandle  # noqa: F401


class EventOverlap:

    def __init__(
        self,
        event: Optional[EventHandle] = None,
        extra_tensors: Optional[Tuple[torch.Tensor]] = None,
    ) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        pass
