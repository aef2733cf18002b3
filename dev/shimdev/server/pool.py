"""The servers a test module keeps running: started on first use, at most ``max_live`` at once
(each holds ~2 GB: its KV cache is real memory), the oldest stopped to make room for a new one
(the answers taken from it and its log stay), the rest stopped at the end."""
from __future__ import annotations

from shimdev.server.process import ServerError


class ServerPool:
    def __init__(self, max_live: int = 2):
        self.max_live, self.live, self.stopped = max_live, {}, {}

    def get(self, key, start):
        """The server under ``key``: the one started before (running or stopped since), else what
        ``start()`` starts once there is room."""
        if key in self.live or key in self.stopped:
            return self.live.get(key) or self.stopped[key]
        while len(self.live) >= self.max_live:
            oldest = next(iter(self.live))
            self.stopped[oldest] = self.live.pop(oldest)
            self.stopped[oldest].stop()
        self.live[key] = start()
        return self.live[key]

    def stop_all(self) -> None:
        """Stop every running server; a process or port that outlives its server fails (all of
        them are stopped first)."""
        errors = []
        for server in self.live.values():
            try:
                server.stop()
            except ServerError as exc:
                errors.append(str(exc))
        if errors:
            raise ServerError("; ".join(errors))
