"""The linter of the test command (dev/shimdev/envs/lint.py): ruff with the checkout's configuration
fails on a finding with one line that says so, and every ``noqa`` names its rule and says why."""

import re
import shutil
import sys
import tokenize

from shimdev import DEV, REPO

from shimdev.envs import lint
NOQA = re.compile(r"#\s*noqa\b(?P<rest>.*)$")


def tree_with(tmp_path, source):
    shutil.copy(str(REPO / "pyproject.toml"), str(tmp_path / "pyproject.toml"))
    (tmp_path / "module.py").write_text(source)
    return tmp_path


def test_a_finding_fails_with_one_line_that_says_so(tmp_path, capfd):
    said = []
    root = tree_with(tmp_path, "import os\n\n\ndef f(x):\n    return x\n")
    assert lint.check(sys.executable, root, log=said.append) is False
    assert "module.py:1:8: F401" in capfd.readouterr().out  # ruff's own line for the finding
    (line,) = said
    assert line.startswith("lint failed: `-m ruff check --no-cache --output-format concise .` in %s: "
                           "it found the problems above -- fix them, or mark a line `# noqa: RULE - why`" % root)


def test_a_clean_tree_passes_and_a_noqa_with_its_reason_silences_its_rule(tmp_path):
    said = []
    root = tree_with(tmp_path, "import os  # noqa: F401 - the import is the point\n")
    assert lint.check(sys.executable, root, log=said.append) is True and said == []


def test_a_noqa_that_silences_nothing_is_a_finding(tmp_path):
    root = tree_with(tmp_path, "import os  # noqa: F401 - used below\n\nprint(os.sep)\n")
    assert lint.check(sys.executable, root, log=lambda line: None) is False


def test_ruff_is_pinned_in_the_runner_venv():
    from shimdev.envs import runner

    assert lint.RUFF_PIN in runner.RUNNER_PINS


def test_every_noqa_names_its_rule_and_says_why():
    """``# noqa: RULE - why`` (or ``(why)``) in the comments of the package, dev/, scripts/ and
    tests/."""
    bare = []
    for top in (REPO / "npu_shim", DEV, REPO / "scripts", REPO / "tests"):
        for path in sorted(top.rglob("*.py")):
            if "_vendor" in path.parts:  # wrapt's own files, where a bundle puts them
                continue
            with open(str(path), "rb") as handle:
                comments = [t for t in tokenize.tokenize(handle.readline) if t.type == tokenize.COMMENT]
            for token in comments:
                found = NOQA.search(token.string)
                if found and not re.match(r"^: [A-Z]+[0-9]+(,[A-Z]+[0-9]+)* +(- |\()\S", found.group("rest")):
                    bare.append("%s:%d: %s" % (path.relative_to(REPO), token.start[0], token.string))
    assert bare == []
