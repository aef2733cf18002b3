"""The simulated NPU in every process of a test server, before its first sglang import.

A test server is started exactly as on a node, ``python -m sglang.launch_server ...``, and sglang
spawns its scheduler and detokenizer; each of them must find ``torch.npu`` in place before sglang
is imported.  ``sitecustomize`` is the shim's (its bootstrap) and a venv runs no ``usercustomize``,
so the server venv (``layer.ensure_server_venv``) carries a ``.pth`` line that imports this module
while ``site`` starts the interpreter -- in the launcher and in every child multiprocessing spawns.

It acts only where ``SIMNPU_SERVER_RELEASE`` names the release (the stub set to use).
"""
import os

if os.environ.get("SIMNPU_SERVER_RELEASE"):
    from shimdev import simnpu

    simnpu.install(release=os.environ["SIMNPU_SERVER_RELEASE"], server=True)
