"""README.md, CHANGELOG.md and docs/ must not drift from the code: the variables, states and exit-code tables,
the commands they document, their links, the README's two commands and its size."""

import glob
import importlib
import os
import re

import pytest

from npu_shim.core import framework
from npu_shim.core.loading import all_variables
from shimdev.beds import release_report

from shimdev.envs import sglang_envs
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "CHANGELOG.md"] + sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
EXIT_CODES_PAGE = "docs/operations.md"
EXIT_TABLE_HEADER = "| code | meaning |"


def read(page):
    with open(os.path.join(REPO, page), encoding="utf-8") as handle:
        return handle.read()


def test_env_table_lists_every_variable_with_its_type_default_and_doc():
    text = read(release_report.ENV_DOC)
    assert text.count(release_report.ENV_START) == 1
    block = text.split(release_report.ENV_START)[1].split(release_report.ENV_END)[0]
    rows = [line for line in block.strip().splitlines()[2:]]
    expected = ["| `%s` | %s | `%r` | %s |" % (v.name, v.kind, v.default, v.doc) for v in all_variables()]
    assert rows == expected


def test_states_table_lists_every_state():
    text = read(EXIT_CODES_PAGE)
    listed = re.findall(r"^\| `(\w+)` \| ", text.split("## Patch states")[1].split("##")[0], re.M)
    assert listed == list(framework.STATES)


def exit_constants():
    main = importlib.import_module("npu_shim.__main__")
    return main, {name: value for name, value in vars(main).items() if name.startswith("EXIT_")}


def test_exit_codes_are_documented_once_and_exactly_the_commands_codes():
    main, constants = exit_constants()
    assert constants, "no EXIT_* constants in npu_shim.__main__"
    tables = [page for page in PAGES if EXIT_TABLE_HEADER in read(page)]
    assert tables == [EXIT_CODES_PAGE], "exit codes are documented in one place only"
    block = read(EXIT_CODES_PAGE).split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in block.split(EXIT_TABLE_HEADER, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        documented |= {int(code) for code in line.split("|")[1].split("/")}
    # 0: fine; 129 / 130 / 131 / 143: bundle, check, selftest stopped by SIGHUP / SIGINT / SIGQUIT /
    # SIGTERM (the signal's shell code, no constant; the row names the rule for the other signals)
    assert documented == {0, 129, 130, 131, 143} | set(constants.values())
    assert EXIT_CODES_PAGE in main.__doc__, "the module docstring points to the one list"
    assert not re.search(r"\b64\b|\b141\b", main.__doc__), "the docstring lists the codes again"


def test_readme_gives_exactly_the_two_commands_ci_runs():
    text = read("README.md")
    assert "python3 scripts/demo.py" in text and "python3 scripts/run_tests.py" in text
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as handle:
        ci = [line for line in handle.read().splitlines() if line.strip() and not line.startswith("#")]
    assert ci[-1] == "exec python3 scripts/run_tests.py"


README_MAX_CHARS = 7000
DOC_MAX_CHARS = 20000  # the reference pages that used to grow into run logs
BOUNDED_DOCS = ["docs/performance.md", "docs/reliability.md", "docs/development.md"]
VALIDATION_PAGE = "docs/validation.md"
VALIDATION_TABLE_HEADER = "| code | real or simulated | how it is checked |"


def test_readme_stays_a_page_for_users():
    text = read("README.md")
    assert len(text) <= README_MAX_CHARS, len(text)
    headings = ["## Quick start", "## What has been validated where", "## Before you roll out",
                "## Try it without an NPU, and run the tests"]
    for heading in headings:
        assert heading in text, heading
    # The first screen: what it is, whether it is safe today, then how to start.
    status = text.index("**Status:**")
    assert status < text.index("## ") and len(text[status:].split("\n\n")[0].splitlines()) <= 2
    assert text.index("## ") == text.index("## Quick start")
    first, last = sglang_envs.ALL_RELEASES[0], sglang_envs.ALL_RELEASES[-1]
    assert "every release from %s to %s" % (first, last) in text


def test_the_validation_table_has_its_own_page_with_a_place_for_graph_mode():
    assert VALIDATION_TABLE_HEADER not in read("README.md")
    text = read(VALIDATION_PAGE)
    assert text.count(VALIDATION_TABLE_HEADER) == 1
    assert "## NPU graph mode" in text
    assert VALIDATION_PAGE.split("/", 1)[1] in read("README.md")


@pytest.mark.parametrize("page", BOUNDED_DOCS)
def test_reference_pages_stay_within_their_size(page):
    assert len(read(page)) <= DOC_MAX_CHARS, (page, len(read(page)))


# What the project's text must not carry: the development machinery's calls and local checkout
# paths (split so that this file does not match itself).
FOREIGN = [re.compile(p) for p in (r"\brun\(" + r"command=", r"\bcarry" + r"=\[", r"(?<![\w.~-])/" + r"work/")]


def tracked_text_files():
    for top in (".", "docs", "scripts", "dev", "npu_shim", "tests", ".ci"):
        for path in sorted(glob.glob(os.path.join(REPO, top, "**", "*"), recursive=True)
                           if top != "." else glob.glob(os.path.join(REPO, "*"))):
            if os.path.isfile(path) and path.endswith((".md", ".py", ".sh", ".yaml", ".txt", ".cfg",
                                                       ".toml", "run", "Dockerfile")):
                yield path


def test_nothing_in_the_project_speaks_of_the_machinery_that_develops_it():
    found = []
    for path in tracked_text_files():
        with open(path, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, 1):
                if any(p.search(line) for p in FOREIGN):
                    found.append("%s:%d: %s" % (os.path.relpath(path, REPO), number, line.strip()[:100]))
    assert not found, found


def anchors(path):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces -> '-'."""
    with open(path, encoding="utf-8") as handle:
        headings = re.findall(r"^#+ (.+)$", handle.read(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_leads_to_a_file_and_its_heading(page):
    here = os.path.dirname(os.path.join(REPO, page))
    for target in re.findall(r"\]\(([^)\s]+)\)", read(page)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(here, path)) if path else os.path.join(REPO, page)
        assert os.path.exists(full), (page, target)
        if anchor:
            assert anchor in anchors(full), (page, target)


@pytest.mark.parametrize("page", PAGES)
def test_no_reference_to_the_project_tracker(page):
    found = re.findall(r"\b[Ii]ssues? \d+|§", read(page))
    assert not found, (page, found)


@pytest.mark.parametrize("page", PAGES)
def test_documented_scripts_exist(page):
    for script in re.findall(r"python3? (scripts/[\w/]+\.py)", read(page)):
        assert os.path.isfile(os.path.join(REPO, script)), (page, script)


@pytest.mark.parametrize("page", [p for p in PAGES if p != "CHANGELOG.md"])  # its old entries name old files
def test_every_file_of_the_repository_a_page_names_exists(page):
    named = re.findall(r"(?<![\w/.~-])((?:npu_shim|tests|dev|scripts|docs)/[\w/.-]*\w\.(?:py|md|c|yaml))", read(page))
    for path in named:
        assert os.path.isfile(os.path.join(REPO, path)), (page, path)


def documented_commands():
    """(page, subcommand, options) for every ``python -m npu_shim SUB --opt ...`` in the pages."""
    found = []
    for page in PAGES:
        for line in read(page).splitlines():
            for match in re.finditer(r"python3? -m npu_shim (\w+)((?: +(?:--?[\w-]+|[A-Z$/<][\w/$.<>-]*))*)", line):
                found.append((page, match.group(1), [word for word in match.group(2).split()
                                                     if word.startswith("-")]))
    return found


def test_documented_commands_and_options_are_the_commands():
    main, _ = exit_constants()
    commands = documented_commands()
    assert {sub for _, sub, _ in commands} >= {"status", "check", "env", "bundle"}
    helps = {}
    for page, sub, options in commands:
        if sub not in helps:
            import contextlib
            import io

            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = main.main([sub, "--help"])
            assert code == 0, (page, sub)
            helps[sub] = out.getvalue()
        for option in options:
            assert re.search(r"(^|[\s\[,])%s\b" % re.escape(option), helps[sub]), (page, sub, option)
