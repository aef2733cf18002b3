"""The deploy recipes of docs/deploy/ (README.md there), run in real containers.

The engine is podman (dev/shimdev/envs/containers.py sets it up: installed with apt when missing, its
own containers.conf and storage under the cache).  The image is Debian's python3 and nothing else
-- no pip, no wrapt -- with the fake sglang tree and demo patch of tests/test_bootstrap.py
installed in its site-packages, its own sitecustomize registering the demo patch, and
dev/shimdev/envs/fake_launch_server.py as ``sglang.launch_server``.  The bundle is the one the suite
builds from this checkout (``python -m npu_shim bundle``, conftest's ``built_bundle``).

Each recipe must show: the summary line of the server and of its spawned child, both patched;
wrapt from the bundle's C build; the bundle unwritable and unchanged; ``status`` and ``check``
exiting 0 with the recipe's environment.  A machine that cannot set up the engine FAILS here.
"""

import json
import os
import platform
import re
import time
from pathlib import Path

import pytest

import npu_shim
from npu_shim.cli import bundle
from shimdev.envs import containers, sglang_envs
from shimdev.envs import fake_launch_server
from test_bootstrap import DEMO_PATCH, FAKE_SGLANG
from test_drop_in import snapshot

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "docs" / "deploy"
SITE = "usr/local/lib/python3.11/dist-packages"
LAUNCH = ["python", "-m", "sglang.launch_server", "--model-path", "/models/demo", "--device", "npu"]
SUMMARY = re.compile(r"^\[npu-shim %s sglang 0\.5\.9 pid ([0-9]+)(?: [^\]]*)?\] demo=applied$"
                     % re.escape(npu_shim.__version__), re.M)
EXIT_NO_SGLANG = 5  # docs/operations.md's exit codes: no sglang importable (status and check)

# The image's own sitecustomize (Debian keeps it in /etc/python3.11): makes the demo patch the
# only one, as the image of tests/test_bootstrap.py does; the shim has to chain it.
IMAGE_SITECUSTOMIZE = """\
try:
    import npu_shim.core.registry
except ImportError:
    pass
else:
    npu_shim.core.registry.PATCH_MODULES[:] = ["demo"]
"""

FAKE_IMAGE = """\
FROM {base}
COPY sitecustomize.py /etc/python3.11/sitecustomize.py
COPY site/ /{site}/
# As on an Ascend sglang image: `python` is there, and no process writes bytecode.
RUN ln -s python3 /usr/bin/python
ENV PYTHONDONTWRITEBYTECODE=1
"""


def fake_sglang_files():
    """The build context of the fake image: test_bootstrap's tree, the launcher, the demo patch."""
    site = dict(FAKE_SGLANG, **{
        "sglang/launch_server.py": Path(fake_launch_server.__file__).read_text(),
        "demo.py": DEMO_PATCH,
    })
    files = {"site/" + name: text for name, text in site.items()}
    files["sitecustomize.py"] = IMAGE_SITECUSTOMIZE
    return files


def _or_fail(make, *args):
    """``make(*args)``, or the test fails saying the engine could not be set up (never skips)."""
    try:
        return make(*args)
    except containers.EngineError as exc:
        pytest.fail("the container engine could not be set up (docs/development.md: the "
                    "test command sets up podman with apt-get as root on Debian/Ubuntu): %s" % exc,
                    pytrace=False)


@pytest.fixture(scope="session")
def podman():
    return _or_fail(containers.ensure_engine)


@pytest.fixture(scope="session")
def python_image(podman):
    return _or_fail(containers.ensure_python_image, podman)


@pytest.fixture(scope="session")
def busybox_image(podman):
    return _or_fail(containers.ensure_busybox_image, podman)


@pytest.fixture(scope="session")
def fake_image(podman, python_image):
    return _or_fail(containers.ensure_built, podman, "fake-sglang",
                    FAKE_IMAGE.format(base=python_image, site=SITE), fake_sglang_files())


@pytest.fixture
def built_here(podman):
    """Builds images under names of this test only, and removes them afterwards."""
    made = []

    def build(containerfile, context, build_args=None):
        tag = "localhost/npu-shim-test/recipe:%d-%d" % (os.getpid(), len(made))
        made.append(tag)
        return containers.build(podman, containerfile, context, tag, build_args)

    yield build
    for tag in made:
        podman.run("rmi", "--force", tag, check=False)


# -- what every recipe must show ---------------------------------------------------------------------

def served_report(output):
    """The fake launcher's report in a server's output."""
    lines = [line for line in output.splitlines() if line.startswith(fake_launch_server.REPORT_PREFIX)]
    assert len(lines) == 1, output[-3000:]
    return json.loads(lines[0][len(fake_launch_server.REPORT_PREFIX):])


def assert_served_patched(output, shim_dir, pythonpath):
    """Server and spawned child patched, each with its summary line; the bundle's own wrapt; the
    bundle not writable from the container."""
    report = served_report(output)
    parent, child = report["parent"], report["spawned"]
    assert parent[:2] == [1001, "applied"] and child[:2] == [1001, "applied"], report
    assert sorted(int(pid) for pid in SUMMARY.findall(output)) == sorted([parent[2], child[2]]), output
    assert report["wrapt"]["source"] == "bundle", report
    assert re.fullmatch(r"cp311-%s-glibc[0-9.]+" % platform.machine(), report["wrapt"]["build"]), report
    assert report["c_ext"] is True
    assert report["shim_dir"] == shim_dir and report["shim_dir_writable"] is False, report
    assert report["pythonpath"] == pythonpath
    return report


def assert_status_and_check(run, shim_dir, build):
    """``status`` and ``check`` exit 0 in the recipe's environment, check with the bundle intact."""
    status = run("python", "-m", "npu_shim", "status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.search(r"^  demo +applied ", status.stdout, re.M), status.stdout
    check = run("python", "-m", "npu_shim", "check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "  bundle: %s: files match its MANIFEST\n" % shim_dir in check.stdout, check.stdout
    assert "  wrapt: bundle %s [%s]\n" % (bundle.WRAPT_VERSION, build) in check.stdout, check.stdout


# -- docker run, as podman run ---------------------------------------------------------------------------

def test_docker_line_with_the_bundle_mounted_read_only(podman, fake_image, built_bundle):
    """docs/deploy/README.md: ``docker run ... -v /srv/npu-shim:/opt/npu-shim:ro -e PYTHONPATH=/opt/npu-shim
    -e SGLANG_ZBAL_LOCAL_MEM_SIZE=49152 IMAGE python -m sglang.launch_server ...``"""
    before = snapshot(built_bundle)

    def run(*command):
        return podman.run("run", "--rm", "--network=none", "-v", "%s:/opt/npu-shim:ro" % built_bundle,
                          "-e", "PYTHONPATH=/opt/npu-shim", "-e", "SGLANG_ZBAL_LOCAL_MEM_SIZE=49152",
                          fake_image, *command, check=False)

    server = run(*LAUNCH, "--exit-after-report")
    assert server.returncode == 0, server.stderr[-3000:]
    report = assert_served_patched(server.stdout + server.stderr, "/opt/npu-shim", "/opt/npu-shim")
    assert_status_and_check(run, "/opt/npu-shim", report["wrapt"]["build"])
    assert snapshot(built_bundle) == before


@pytest.mark.parametrize("command", ["status", "check"])
def test_status_and_check_exit_5_in_an_image_without_sglang(command, podman, python_image, built_bundle):
    """The bundle mounted into an image that has python3 but no sglang (the wrong image)."""
    proc = podman.run("run", "--rm", "--network=none", "-v", "%s:/opt/npu-shim:ro" % built_bundle,
                      "-e", "PYTHONPATH=/opt/npu-shim", python_image, "python3", "-m", "npu_shim", command,
                      check=False)
    assert proc.returncode == EXIT_NO_SGLANG, proc.stdout + proc.stderr


# -- the Dockerfile -------------------------------------------------------------------------------------

@pytest.mark.parametrize("image_pythonpath", [None, "/opt/image-python"])
def test_dockerfile_bakes_the_bundle_in_and_runs_on_a_read_only_root(
        image_pythonpath, podman, fake_image, built_bundle, built_here):
    """docs/deploy/Dockerfile on the image (one that sets its own PYTHONPATH too), run with
    ``--read-only``: nothing can be written, nothing needs to be."""
    base = fake_image
    if image_pythonpath:
        base = containers.ensure_built(podman, "fake-sglang-pythonpath",
                                       "FROM %s\nENV PYTHONPATH=%s\n" % (fake_image, image_pythonpath), {})
    image = built_here(DEPLOY / "Dockerfile", built_bundle.parent, {"SGLANG_IMAGE": base})

    def run(*command):
        return podman.run("run", "--rm", "--read-only", "--network=none", image, *command, check=False)

    server = run(*LAUNCH, "--exit-after-report")
    assert server.returncode == 0, server.stderr[-3000:]
    expected_path = "/opt/npu-shim" + (":" + image_pythonpath if image_pythonpath else "")
    report = assert_served_patched(server.stdout + server.stderr, "/opt/npu-shim", expected_path)
    assert_status_and_check(run, "/opt/npu-shim", report["wrapt"]["build"])


# -- the Kubernetes manifest, through podman kube play -------------------------------------------------

def manifest_images(text):
    """{container name: image} of a manifest's containers and init containers."""
    return dict(re.findall(r"^  - name: (\S+)\n    image: (\S+)$", text, re.M))


def wait_for_report(podman, container, timeout=120):
    """The container's output once the launcher reported (or it stopped)."""
    deadline = time.monotonic() + timeout
    while True:
        logs = podman.run("logs", container, check=False)
        output = logs.stdout + logs.stderr
        if fake_launch_server.REPORT_PREFIX in output or time.monotonic() > deadline:
            return output
        state = podman.run("inspect", "--format", "{{.State.Status}}", container, check=False).stdout.strip()
        if state not in ("running", "created", "configured", "initialized", ""):
            return output
        time.sleep(0.5)


def test_kubernetes_manifest_plays_as_written(podman, busybox_image, fake_image, built_bundle, built_here):
    """docs/deploy/kubernetes.yaml, unchanged: its images are this test bed's, tagged with the
    names the file gives (no registry is reachable); the pod runs without a network."""
    manifest = DEPLOY / "kubernetes.yaml"
    text = manifest.read_text()
    images = manifest_images(text)
    assert sorted(images) == ["npu-shim", "sglang"], images
    pod = re.search(r"^metadata:\n  name: (\S+)$", text, re.M).group(1)
    bundle_image = built_here(DEPLOY / "bundle.Dockerfile", built_bundle.parent, {"BASE": busybox_image})
    # One pod of this name at a time on this machine: other checkouts play the same file.
    with sglang_envs.file_lock("container-kube-play"):
        podman.run("tag", bundle_image, images["npu-shim"])
        podman.run("tag", fake_image, images["sglang"])
        try:
            podman.run("kube", "play", "--replace", "--network", "none", manifest, timeout=300)
            container = "%s-sglang" % pod
            output = wait_for_report(podman, container)
            report = assert_served_patched(output, "/shim/npu-shim", "/shim/npu-shim")

            def run(*command):
                return podman.run("exec", container, *command, check=False)

            assert_status_and_check(run, "/shim/npu-shim", report["wrapt"]["build"])
        finally:
            podman.run("kube", "down", manifest, check=False, timeout=120)
            podman.run("rmi", images["npu-shim"], images["sglang"], check=False)

