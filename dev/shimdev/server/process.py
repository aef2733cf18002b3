"""One real sglang server: started in its own session, waited for, talked to, and stopped whole.

    with Server("0.5.9", model, args=["--tp-size", "2"], zbal=True, shim="on") as server:
        server.generate([1, 2, 3], max_new_tokens=8)          # sglang's /generate
        server.openai().chat.completions.create(...)           # the real openai client

``start()`` runs ``python -m sglang.launch_server`` as on a node (the simulated NPU put in place in
every process of it by ``startup.py``, through the server venv of ``layer.py``) in a new session,
its output in a log file, and waits until ``/health_generate``
answers -- at most ``ready_timeout`` seconds; a server that exits or does not come up fails with
the log's last lines.  ``stop()`` sends SIGTERM to the session's process group (sglang's launcher
then kills its own children), SIGKILL to whatever is left after ``stop_timeout``, and checks that
no process of the session remains and that the port is free again -- on failure too, and at
interpreter exit for a server nobody stopped.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from shimdev.envs import realsglang
from shimdev.server.layer import ensure_release_server_layer, ensure_server_layer, ensure_server_venv

#: What every test server runs with: the simulated NPU's dense path (ascend attention), no warm-up
#: request (it costs tens of seconds on 2 cores and tests nothing here), and an idle scheduler that
#: sleeps (one that polls costs a core's fifth: a suite keeps several).
BASE_ARGS = ("--device", "npu", "--attention-backend", "ascend",
             "--skip-server-warmup", "--sampling-backend", "pytorch", "--grammar-backend", "none",
             "--log-level", "info", "--sleep-on-idle")
#: ``graphs=False`` (eager, every forward run op by op) and ``graphs=True``: sglang's default on
#: Ascend, decode captured into NPU graphs -- here of two batch sizes, each warmed up twice and
#: captured into the one pool they share, then replayed with its attention lengths updated.
EAGER_ARGS = ("--disable-cuda-graph",)
GRAPH_ARGS = ("--cuda-graph-bs", "1", "2")

_LIVE: set = set()

#: What the servers of this process cost, for the suite's cost report (shimdev.envs.suitecost): the
#: configuration of every server started (``Server.config``), in order; the CPU seconds of their
#: whole process trees, read from /proc as each stops (``server_cpu_s``); and the part of those
#: that this process's own RUSAGE_CHILDREN also counts, reaped while stopping (``reaped_cpu_s``).
STARTED: list = []
COST = {"server_cpu_s": 0.0, "reaped_cpu_s": 0.0}


class ServerError(AssertionError):
    """The server did not come up, or died; the message ends with its log's last lines."""


@functools.lru_cache(maxsize=None)
def _private_dir() -> Path:
    """This process's own directory (mkdtemp: 0700, a new name): nothing another user of a shared
    /tmp made or links to; removed when the process exits."""
    path = tempfile.mkdtemp(prefix="npu-shim-server-")
    atexit.register(shutil.rmtree, path, True)
    return Path(path)


def _empty_dir() -> Path:
    """A directory with nothing in it: first on PYTHONPATH where the shim is absent."""
    d = _private_dir() / "no-shim"
    d.mkdir(exist_ok=True)
    return d


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 up): a readiness probe to a port not
    yet listened on can be given that same port as its own and connect to itself, reading its own
    request back (seen once as ``BadStatusLine: GET /health_generate``); and sglang derives other
    ports from it (0.5.11 adds 10000 for its gRPC port and refuses one past 65535)."""
    import random

    for _ in range(1000):
        port = random.randrange(20000, 32768)
        if port_is_free(port):
            return port
    raise ServerError("no free port in 20000-32767")


def port_is_free(port: int) -> bool:
    """No socket listens on ``port`` (one in TIME_WAIT does not count: servers bind with
    SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _session_stats(sid: int):
    """(pid, the fields of /proc/<pid>/stat after the command name) of each process of session
    ``sid``, zombies included (Linux /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            yield int(entry), fields


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    return [pid for pid, fields in _session_stats(sid) if fields[0] != "Z"]


def tree_cpu_seconds(sid: int) -> float:
    """User + system CPU seconds of every process of session ``sid`` (zombies too: their time
    is theirs until reaped) with what each had reaped of its own children (Linux /proc)."""
    ticks = sum(sum(int(f) for f in fields[11:15]) for _, fields in _session_stats(sid))  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    import resource

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def shim_metrics(server: "Server") -> dict:
    """The shim's samples in the server's ``/metrics``, as an operator's scrape reads them:
    ``{"state": {(pid, patch): {state: value}}, "detail": {(pid, patch): {detail: value}}}``."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = server.get("/metrics")
    if status != 200:
        raise ServerError(f"/metrics answered {status} (is --enable-metrics on?)\n{server.log_tail()}")
    out = {"state": {}, "detail": {}}
    for family in text_string_to_metric_families(text):
        kind = {"npu_shim_patch_state": "state", "npu_shim_patch_detail": "detail"}.get(family.name)
        for sample in family.samples if kind else ():
            key = (int(sample.labels["pid"]), sample.labels["patch"])
            out[kind].setdefault(key, {})[sample.labels[kind]] = sample.value
    return out


def current_states(metrics: dict) -> dict:
    """(pid, patch) -> the one state at 1 of the six written (an AssertionError otherwise)."""
    out = {}
    for key, states in metrics["state"].items():
        assert len(states) == 6 and sorted(states.values()) == [0] * 5 + [1], (key, states)
        (out[key],) = [state for state, value in states.items() if value == 1]
    return out


def schedulers(server: "Server") -> dict:
    """TP rank -> pid of each scheduler process of the server (sglang's process title:
    ``sglang::scheduler_TP1``, or ``sglang::scheduler`` alone where a release names no rank of one)."""
    out = {}
    for pid in session_pids(os.getsid(server.proc.pid)):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().decode(errors="replace")
        except OSError:
            continue
        found = re.match(r"sglang::scheduler(\S*)", cmdline)
        if found:
            rank = re.search(r"TP(\d+)", found.group(1))
            out[int(rank.group(1)) if rank else 0] = pid
    return out


_SUMMARY = re.compile(r"\[npu-shim \S+ sglang \S+ pid (\d+) ?([^\]]*)\] (zbal=\w+.*)$")


def summaries(server: "Server") -> dict:
    """pid -> {"role": the role in its tag ('tp 0/2', 'detokenizer', ''), "states": {patch: state}}
    of every summary line in the server's log (one per process that decided its patches)."""
    out = {}
    for line in server.log_text().splitlines():
        found = _SUMMARY.match(line)
        if found:
            pid = int(found.group(1))
            assert pid not in out, f"two summary lines of pid {pid}"
            out[pid] = {"role": found.group(2), "states": dict(re.findall(r"(\w+)=(\w+)", found.group(3)))}
    return out


class Server:
    def __init__(self, version: str, model: Path, *, args=(), env: dict | None = None,
                 zbal: bool = False, shim: str = "on", log_path: Path | None = None,
                 port: int | None = None, ready_timeout: float = 240, stop_timeout: float = 20,
                 wait_ready: bool = True, graphs: bool = False):
        self.version, self.model, self.graphs, self.shim = version, Path(model), graphs, shim
        self.switches = dict(env or {})
        self.port = port or free_port()
        self.args = [*BASE_ARGS, *(GRAPH_ARGS if graphs else EAGER_ARGS), "--model-path", str(model),
                     "--host", "127.0.0.1", "--port", str(self.port), *args]
        if "--nccl-port" not in args:
            # Left to itself, sglang 0.5.9+ takes the torch.distributed store's port from the
            # kernel's ephemeral range (bind to 0, close, bind again much later), where any
            # outgoing connection on the machine may take it first: a full run with other servers
            # up failed once with EADDRINUSE there.  Ours comes from below that range.
            nccl_port = free_port()
            while nccl_port == self.port:
                nccl_port = free_port()
            self.args += ["--nccl-port", str(nccl_port)]
        if shim not in ("on", "disabled", "absent"):
            raise ValueError("shim is 'on', 'disabled' (NPU_SHIM_ENABLED=0) or 'absent' (not on "
                             "PYTHONPATH): %r" % (shim,))
        shim_root = _empty_dir() if shim == "absent" else realsglang.REPO
        argv, run_env = realsglang.release_command(
            version, env, zbal=zbal, shim_enabled={"on": True, "disabled": False}.get(shim),
            shim_root=shim_root)
        run_env["PYTHONPATH"] += os.pathsep + str(ensure_server_layer())
        release_layer = ensure_release_server_layer(realsglang.table_release(version))
        if release_layer is not None:
            run_env["PYTHONPATH"] += os.pathsep + str(release_layer)
        if argv[0] == str(realsglang.sglang_envs.ensure_base()):
            argv = [str(ensure_server_venv())]
        else:
            raise ServerError(f"sglang {version} does not run on the base venv ({argv[0]}): the "
                              f"server venv sits on the base only")
        run_env.setdefault("SIMNPU_SERVER_RELEASE", realsglang.table_release(version))
        run_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        run_env.setdefault("HF_HUB_OFFLINE", "1")
        run_env.setdefault("SIMZBAL_RENDEZVOUS", "1")
        run_env.setdefault("SIMZBAL_RENDEZVOUS_TIMEOUT", "240")  # ranks start minutes apart under load
        run_env.setdefault("SIMNPU_DEVICE_COUNT", "8")
        self.argv = argv + ["-m", "sglang.launch_server", *self.args]
        self.env = run_env
        self.log_path = Path(log_path) if log_path else _private_dir() / f"server-{self.port}.log"
        self.ready_timeout, self.stop_timeout, self.wait_ready = ready_timeout, stop_timeout, wait_ready
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    def config(self) -> str:
        """What makes this server what it is, in one line: the release, the shim, its arguments
        and its environment switches -- ports and per-server paths left out, so two servers
        started alike say the same (the suite's cost report counts servers started twice)."""
        args, skip = [], False
        for arg in self.args:
            if skip:
                skip = False
            elif arg in ("--port", "--nccl-port", "--dist-init-addr", "--host"):
                skip = True
            elif arg not in BASE_ARGS:
                args.append(arg)

        def plain(value):
            value = str(value)
            return "<path>" if os.path.isabs(value) else re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:<port>", value)

        switches = " ".join("%s=%s" % (k, plain(v)) for k, v in sorted(self.switches.items()))
        return " ".join(filter(None, ["sglang %s shim=%s" % (self.version, self.shim), " ".join(args), switches]))

    # -- life cycle ---------------------------------------------------------------------------------

    def start(self) -> "Server":
        STARTED.append(self.config())
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         cwd=self.log_path.parent)
        _LIVE.add(self)
        if self.wait_ready:
            try:
                self.wait_until_ready()
            except BaseException:
                self.stop()
                raise
        return self

    def wait_until_ready(self) -> float:
        """Seconds from start until ``/health_generate`` answered 200."""
        started = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"sglang {self.version} server exited {code} before it was ready"
                                  f"\n{self.log_tail()}")
            try:
                if self.get("/health_generate", timeout=30)[0] == 200:
                    return time.monotonic() - started
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() - started > self.ready_timeout:
                raise ServerError(f"sglang {self.version} server not ready after "
                                  f"{self.ready_timeout:.0f}s\n{self.log_tail()}")
            time.sleep(0.5)

    def wait_exit(self, timeout: float) -> int | None:
        """The launcher's exit code within ``timeout`` seconds, or None."""
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return self.returncode

    def stop(self) -> list[int]:
        """Stop the whole session; returns the pids that needed SIGKILL.  Raises ServerError when a
        process of it or the port outlives the stop."""
        if self.proc is None:
            return []
        sid = self.proc.pid
        killed = []
        reaped_before = _children_cpu_seconds()
        COST["server_cpu_s"] += tree_cpu_seconds(sid)
        if self.proc.poll() is None:
            try:
                os.killpg(sid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.stop_timeout
        while session_pids(sid) and time.monotonic() < deadline:
            self.proc.poll()
            time.sleep(0.2)
        for pid in session_pids(sid):
            killed.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.returncode = self.proc.wait(timeout=30)
        COST["reaped_cpu_s"] += _children_cpu_seconds() - reaped_before
        _LIVE.discard(self)
        deadline = time.monotonic() + 10
        while (session_pids(sid) or not port_is_free(self.port)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = session_pids(sid)
        if left or not port_is_free(self.port):
            raise ServerError(f"after stopping the server: processes {left} left, port {self.port} "
                              f"{'free' if port_is_free(self.port) else 'still bound'}")
        return killed

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- talking to it --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 60) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode()
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, {"text": text}

    def generate(self, input_ids, max_new_tokens: int = 8) -> list[int]:
        """Greedy output token ids of sglang's ``/generate`` for ``input_ids``."""
        status, out = self.post("/generate", {
            "input_ids": list(input_ids),
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})
        if status != 200:
            raise ServerError(f"/generate answered {status}: {out}\n{self.log_tail()}")
        return out["output_ids"]

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=300, max_retries=0)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return f"--- {self.log_path} (last {n} lines) ---\n" + "\n".join(self.log_text().splitlines()[-n:])


@atexit.register
def _stop_forgotten() -> None:
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - at exit, stop every other one too
            pass
