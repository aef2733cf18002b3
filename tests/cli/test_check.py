"""npu_shim/cli/check.py where the shim never started: what the check child reports, and what
``print_report`` makes of it (the command itself, against bundles and bare venvs:
tests/test_drop_in.py)."""

from test_bootstrap import last_json, run, tree  # noqa: F401 - ``tree`` is a fixture

NOT_STARTED = """
    import contextlib, io, json
    from npu_shim import _bootstrap
    from npu_shim.cli import check
    from npu_shim.runtime import activation
    before = {"wrapped": check.wrapped_targets([]), "records": activation.RUNTIME.records}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        check.child_main(_bootstrap.WATCHER)
    report = json.loads(out.getvalue().strip().splitlines()[-1][len("npu-shim-check:"):])
    report["bundle"] = check.bundle_facts()  # the parent's part of the report (``run_check``)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        check.print_report(report)
    print(json.dumps({"before": before, "report": report, "text": text.getvalue()}))
"""


def test_check_in_a_process_where_the_shim_never_started(tree):
    """npu-shim's sitecustomize shadowed by the image's (``shim=False``): importing sglang's target
    modules changes nothing, and the report says the shim was not active without raising."""
    out = last_json(run(tree, NOT_STARTED, shim=False))
    assert out["before"] == {"wrapped": {}, "records": None}
    report = out["report"]
    assert report["shim_active"] is False and report["states"] == {} and report["wrapped"] == {}
    assert report["imports"] == {"sglang.srt.utils.common": "ok"}
    assert report["sglang"]["version"] == "0.5.9"
    assert report["wrapt"]["source"] == "image"  # where it would come from: nothing loaded it
    text = out["text"]
    assert "shim active at start-up: NO: npu-shim's sitecustomize did not arm it" in text
    assert "(no patch was decided: sglang's target modules were not imported with the shim on)" in text
