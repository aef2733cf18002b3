"""The ranks of one zbal world meeting at its bootstrap address (memfabric's config server).

``meet("tcp://host:port", rank, world_size)``: rank 0 listens at the address and waits until
every other rank has said who it is; each other rank connects (retrying while rank 0 is not up
yet) and waits for rank 0's answer: the world's ranks, in order.  A malformed address, a rank
outside the world, two ranks with one number, two worlds of different sizes at one address, or a
rank missing after ``SIMZBAL_RENDEZVOUS_TIMEOUT`` seconds (default 60) fail with
RendezvousError -- where a device's bootstrap would fail or hang.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time

_URL = re.compile(r"tcp://(?P<host>[^:/\s]+):(?P<port>\d{1,5})\Z")


class RendezvousError(RuntimeError):
    pass


def _timeout() -> float:
    return float(os.environ.get("SIMZBAL_RENDEZVOUS_TIMEOUT", 60))


def parse(url: str) -> tuple[str, int]:
    match = _URL.match(url or "")
    if not match or not 0 < int(match.group("port")) < 65536:
        raise RendezvousError("malformed bootstrap address %r (expected tcp://HOST:PORT)" % (url,))
    return match.group("host"), int(match.group("port"))


def _send(sock, obj) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _receive(sock) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise RendezvousError("the peer closed the bootstrap connection")
        data += chunk
    return json.loads(data)


def meet(url: str, rank: int, world_size: int) -> list[int]:
    host, port = parse(url)
    if not 0 <= rank < world_size:
        raise RendezvousError("rank %d is outside a world of %d" % (rank, world_size))
    if world_size == 1:
        return [0]
    deadline = time.monotonic() + _timeout()
    if rank == 0:
        return _serve(host, port, world_size, deadline)
    return _join(host, port, rank, world_size, deadline)


def _serve(host, port, world_size, deadline) -> list[int]:
    with socket.create_server((host, port), reuse_port=False) as server:
        peers = {}
        while len(peers) < world_size - 1:
            server.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = server.accept()
            except socket.timeout:
                raise RendezvousError("ranks %s of %d did not join at %s:%d" % (
                    sorted(set(range(1, world_size)) - set(peers)), world_size, host, port)) from None
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            hello = _receive(conn)
            if hello.get("world") != world_size or hello.get("rank") in peers or hello.get("rank") == 0:
                _send(conn, {"error": "rank %r of a world of %r does not fit a world of %d"
                                      % (hello.get("rank"), hello.get("world"), world_size)})
                conn.close()
                continue
            peers[hello["rank"]] = conn
        world = [0, *sorted(peers)]
        for conn in peers.values():
            with conn:
                _send(conn, {"world": world})
        return world


def _join(host, port, rank, world_size, deadline) -> list[int]:
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RendezvousError("rank 0 never listened at %s:%d" % (host, port)) from None
            time.sleep(0.2)
    with sock:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        _send(sock, {"rank": rank, "world": world_size})
        try:
            answer = _receive(sock)
        except socket.timeout:
            raise RendezvousError("rank 0 at %s:%d did not answer" % (host, port)) from None
    if "error" in answer:
        raise RendezvousError(answer["error"])
    return answer["world"]
