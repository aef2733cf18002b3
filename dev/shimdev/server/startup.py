"""The simulated NPU in every process of a test server, before its first sglang import.

A test server is started exactly as on a node, ``python -m sglang.launch_server ...``, and sglang
spawns its scheduler and detokenizer; each of them must find ``torch.npu`` in place before sglang
is imported.  ``sitecustomize`` is the shim's (its bootstrap) and a venv runs no ``usercustomize``,
so the server venv (``layer.ensure_server_venv``) carries a ``.pth`` line that imports this module
while ``site`` starts the interpreter -- in the launcher and in every child multiprocessing spawns.

It acts only where ``SIMNPU_SERVER_RELEASE`` names the release (the stub set to use); with
``SIMNPU_SERVER_DEVICE=cpu`` the process has no NPU at all (a ``--device cpu`` server).  More
switches (the first and the last for the GLM-4 MoE servers, tests/test_real_server_moe.py):

* ``SIMNPU_FUSED_KERNEL=1``: the image's sgl-kernel-npu has ``norm.split_qkv_rmsnorm_rope`` (the
  version with partial rotary), as an image built with a 2026 sgl-kernel-npu does whatever its
  sglang -- its pure-torch stand-in (``dual_stream_kernels.py``);
* ``SIMNPU_JOURNAL_DIR=<dir>``: every process keeps a journal of its zbal, allocator and graph
  events there (``server/journal.py``);
* ``SIMNPU_SANITIZE_DIR=<dir>``: every process multiprocessing spawns (the scheduler, the
  detokenizer) runs under the stream sanitizer for its whole life and keeps
  ``<dir>/sanitizer-<pid>.json`` up to date (``server/sanitizer.py``).
"""
import os
import sys

if os.environ.get("SIMNPU_SERVER_RELEASE") and os.environ.get("SIMNPU_SERVER_DEVICE") == "cpu":
    # a server on --device cpu: the machine has no NPU (no torch.npu, no torch_npu), only the
    # stubs of what this test bed lacks (triton, sgl_kernel)
    from shimdev import simnpu

    simnpu.install_without_npu(release=os.environ["SIMNPU_SERVER_RELEASE"])
elif os.environ.get("SIMNPU_SERVER_RELEASE"):
    from shimdev import simnpu

    simnpu.install(release=os.environ["SIMNPU_SERVER_RELEASE"], server=True)
    if os.environ.get("SIMNPU_FUSED_KERNEL") == "1":
        from shimdev.beds import dual_stream_kernels

        simnpu.add_stub(dual_stream_kernels.KERNEL_MODULE,
                        split_qkv_rmsnorm_rope=dual_stream_kernels.split_qkv_rmsnorm_rope)
    if os.environ.get("SIMNPU_JOURNAL_DIR"):
        from shimdev.server import journal

        journal.start(os.environ["SIMNPU_JOURNAL_DIR"])
    if os.environ.get("SIMNPU_SANITIZE_DIR") and "--multiprocessing-fork" in sys.argv:
        from shimdev.server import sanitizer

        sanitizer.run_for_process(os.environ["SIMNPU_SANITIZE_DIR"])
