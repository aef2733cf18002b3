"""The packages ``sglang.launch_server`` needs beyond what importing its modules needs.

Measured on 0.5.9 and 0.5.11 (../shared/docs/real-sglang-server-on-cpu.md): the HTTP server and
its request parsing, the metrics, and on 0.5.11 ``soundfile`` (imported by the multimodal
processors at start-up).  ``uvicorn`` and ``fastapi`` are in the base already.  Without
``openai_harmony`` only ``/v1/responses`` is lost (sglang logs it), so it is not installed.

One dependency layer (``sglang_envs.ensure_deps_layer``: resolved against the base, only the delta
installed, content-addressed), shared by every release, put on ``PYTHONPATH`` after a release's
own layers.
"""
from __future__ import annotations

from pathlib import Path

from shimdev import sglang_envs

SERVER_PACKAGES = ("uvloop", "python-multipart", "interegular", "prometheus-client", "jsonschema",
                   "soundfile==0.13.1")


def ensure_server_layer(*, log=None) -> Path:
    return sglang_envs.ensure_deps_layer({"deps": sorted(SERVER_PACKAGES), "nodeps": []}, log=log)
