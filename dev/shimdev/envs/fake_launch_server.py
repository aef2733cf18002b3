"""``sglang.launch_server`` of the test image in tests/test_deploy.py (copied there as
``sglang/launch_server.py`` beside the fake sglang tree of tests/test_bootstrap.py).

It does what the deploy recipes need to see of a server: imports the module the demo patch
targets, starts a child with multiprocessing's spawn as sglang starts its scheduler, and prints one
line, ``deploy-report {json}``, with what both processes saw.  Then it serves -- sleeps until
SIGTERM, as a server would in a pod -- unless given ``--exit-after-report``.  Its other arguments
(``--model-path ...``) are a real launch command's, and ignored.

Runs on the image's python3 alone; never imported from dev/ (it is not part of shimdev's API).
"""
import json
import multiprocessing
import os
import signal
import sys

REPORT_PREFIX = "deploy-report "


def patched_here():
    """[what the wrapped function returns, the demo patch's state, this pid]."""
    from sglang.srt.utils import get_npu_memory_capacity

    try:
        import npu_shim
    except ImportError:  # the shim is not on this process's path
        return [get_npu_memory_capacity(), None, os.getpid()]
    return [get_npu_memory_capacity(), npu_shim.states().get("demo", {}).get("state"), os.getpid()]


def scheduler(queue):
    queue.put(patched_here())


def spawned():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=scheduler, args=(queue,))
    child.start()
    try:
        return queue.get(timeout=120)
    finally:
        child.join(30)


def wrapt_origin():
    try:
        from npu_shim.runtime import wrapt_loader
    except ImportError:
        return None
    origin = wrapt_loader.loaded_origin()
    return origin.as_dict() if origin else None


def shim_dir():
    try:
        import npu_shim
    except ImportError:
        return None
    return os.path.dirname(os.path.dirname(os.path.abspath(npu_shim.__file__)))


def report():
    parent = patched_here()
    where = shim_dir()
    return {"parent": parent, "spawned": spawned(), "wrapt": wrapt_origin(),
            "c_ext": "npu_shim._wrapt._wrappers" in sys.modules,
            "shim_dir": where, "shim_dir_writable": bool(where) and os.access(where, os.W_OK),
            "pythonpath": os.environ.get("PYTHONPATH"),
            "python": "%d.%d.%d" % sys.version_info[:3]}


def serve():
    # PID 1 of a container ignores SIGTERM unless it handles it: stopping the pod must not wait.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    while True:
        signal.pause()


def main(argv):
    print(REPORT_PREFIX + json.dumps(report()), flush=True)
    if "--exit-after-report" not in argv:
        serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
