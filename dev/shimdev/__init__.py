"""shimdev: npu-shim's development tooling -- never part of what users put on PYTHONPATH.

What lives here (each module says more):

* ``sglang_envs``    the releases' layered environments, and the one import of the test bed's names:
                     ``releases`` (the supported releases), ``buildcache`` (the cache, locks, pip
                     runs, content-addressed builds), ``wheels`` (wheels and sources),
                     ``npu_layers`` (the zbal and no-CANN torch-npu layers);
* ``runner``         the test runner's venv (torch, wrapt, pytest), shared by the test command and
                     the benchmarks;
* ``machine``        what the test command needs of a machine: the CPythons 3.9-3.13 (through
                     ``PYENV_ROOT`` and ``PATH``), a C compiler;
* ``realsglang``     run code in a release's environment with the simulated NPU;
* ``simnpu``         a simulated Ascend NPU (``torch.npu`` on the CPU, a recorded event log);
* ``simzbal``       the native half of memfabric-zbal 1.2.0, simulated (``zbal_native.c`` and the
                     module it fills); ``import zbal`` gets the wheel's own Python files over it
                     where the zbal layer (``npu_layers.ensure_zbal_layer``) is on the path;
* ``demo_features``  the per-patch drivers of the demo and the import probe;
* ``release_beds``   the set-ups over a release's real modules those drivers and the real-release
                     tests stand on (a stubbed scheduler and model runner, a synthetic GLM-4 MoE);
* ``expected_states`` the release table; ``mla_kernels``, ``dual_stream_kernels`` NPU kernel
                     stand-ins; ``import_probe``, ``drop_in_probe`` child-process probes;
* ``release_report``, ``dual_stream_bench``, ``mla_real_bench`` code shared by a script and a test;
* ``containers``     podman and the local images the deploy recipes run in (tests/test_deploy.py);
                     ``fake_launch_server`` the ``sglang.launch_server`` of those images.

The one import convention: ``dev/`` (the directory holding this package) is put first on
``sys.path`` -- by tests/conftest.py for the tests, by the one-line prelude of each script in
scripts/, by ``PYTHONPATH`` (``realsglang.release_env``) for the child processes -- and everything is
imported as ``shimdev.<module>`` (``from shimdev import simnpu``).  Nothing is loaded by file path.

Why ``dev/shimdev`` and not a top-level package: the repository root is on users' PYTHONPATH, and
only ``sitecustomize`` and ``npu_shim`` may be importable from it (tests/test_layout.py).
"""
from pathlib import Path

#: dev/ -- the directory that goes on sys.path / PYTHONPATH.
DEV = Path(__file__).resolve().parent.parent
#: The repository root.
REPO = DEV.parent
