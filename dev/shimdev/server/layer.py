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

from shimdev.envs import sglang_envs

SERVER_PACKAGES = ("uvloop", "python-multipart", "interegular", "prometheus-client", "jsonschema",
                   "soundfile==0.13.1")


#: What one release's server imports beyond those, pinned as its wheel pins it: 0.5.7 and 0.5.8
#: import torchao every time a model is loaded (``ModelRunner.load_model`` ->
#: ``apply_torchao_config_to_model``, unguarded; 0.5.9 only with a torchao config).  Installed
#: without its dependencies (the base has torch), in a layer of its own.
RELEASE_PACKAGES = {"0.5.7": ("torchao==0.9.0",), "0.5.8": ("torchao==0.9.0",),
                    "0.5.8.post1": ("torchao==0.9.0",)}


def ensure_server_layer(*, log=None) -> Path:
    return sglang_envs.ensure_deps_layer({"deps": sorted(SERVER_PACKAGES), "nodeps": []}, log=log)


def ensure_release_server_layer(release: str, *, log=None) -> Path | None:
    """The layer of RELEASE_PACKAGES[release], or None when the release needs none."""
    packages = RELEASE_PACKAGES.get(release)
    if not packages:
        return None
    return sglang_envs.ensure_deps_layer({"deps": [], "nodeps": sorted(packages)}, log=log)


def ensure_server_venv(*, log=None) -> Path:
    """The python a test server runs: a small venv on top of the base (a ``.pth`` puts the base's
    site-packages on its path, as the editable install's does) whose second ``.pth`` imports
    ``shimdev.server.startup`` at start-up -- which installs the simulated NPU where
    ``SIMNPU_SERVER_RELEASE`` is set, and does nothing elsewhere."""
    base = sglang_envs.ensure_base(log=log)
    key = {"base": sglang_envs.base_dir().name, "layout": sglang_envs.LAYOUT, "startup": 1}
    d = sglang_envs.layered_dir() / f"server-venv-{sglang_envs.digest(key)}"

    def build(final: Path) -> dict:
        sglang_envs.run([str(base), "-m", "venv", "--without-pip", str(final)],
                        "creating the server venv")
        sglang_envs.put_base_under(final)
        (sglang_envs.site_packages(final) / "simnpu_server.pth").write_text(
            "import os; os.environ.get('SIMNPU_SERVER_RELEASE') and __import__('shimdev.server.startup')\n")
        return {"key": key}

    return sglang_envs.build_once(d, f"layered-{d.name}", build, in_place=True) / "bin" / "python"
