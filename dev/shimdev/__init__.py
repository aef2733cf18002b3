"""shimdev: npu-shim's development tooling -- never part of what users put on PYTHONPATH.

Grouped by role (each package and module says more):

* ``envs``     the environments the code runs in: every sglang release's layered environment
               (``envs.sglang_envs``, ``releases``, ``wheels``, ``npu_layers``, ``buildcache``), the
               test runner's venv (``runner``), what a machine needs (``machine``), running code in a
               release with the simulated NPU (``realsglang``), the deploy recipes' images
               (``containers``, ``fake_launch_server``), the linter and mutation runs (``lint``,
               ``mutation``);
* ``simnpu``   a simulated Ascend NPU (``torch.npu`` on the CPU, NPU graphs, a recorded event log,
               the stream sanitizer); ``simzbal`` the native half of memfabric-zbal 1.2.0, simulated
               (``import zbal`` gets the wheel's own Python files over it where the zbal layer is on
               the path);
* ``server``   the server bed: real ``sglang.launch_server`` processes on the simulated NPU, their
               models, logs, journals and ``/metrics``;
* ``beds``     what the tests stand on inside a release process: set-ups over a release's real
               modules, the demo's drivers, child-process probes, NPU kernel stand-ins, the expected
               states per release; ``programs`` the programs the tests run in a release process;
* ``bench``    the benchmarks: the rows of ``scripts/bench.py``'s table and the code measuring them.

The one import convention: ``dev/`` (the directory holding this package) is put first on
``sys.path`` -- by tests/conftest.py for the tests, by the one-line prelude of each script in
scripts/, by ``PYTHONPATH`` (``envs.realsglang.release_env``) for the child processes -- and
everything is imported as ``shimdev.<package>.<module>`` (``from shimdev.envs import realsglang``).
Nothing is loaded by file path.

Why ``dev/shimdev`` and not a top-level package: the repository root is on users' PYTHONPATH, and
only ``sitecustomize`` and ``npu_shim`` may be importable from it (tests/test_layout.py).
"""
from pathlib import Path

#: dev/ -- the directory that goes on sys.path / PYTHONPATH.
DEV = Path(__file__).resolve().parent.parent
#: The repository root.
REPO = DEV.parent
