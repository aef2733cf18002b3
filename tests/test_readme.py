"""README.md must not drift from the code: the variables table and the states table."""

import os
import re

from npu_shim.core import config, framework
from npu_shim.core.loading import all_variables

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        return handle.read()


def test_env_table_lists_every_variable_with_its_type_default_and_doc():
    block = readme().split("<!-- env-table -->")[1].split("<!-- /env-table -->")[0]
    rows = [line for line in block.strip().splitlines()[2:]]
    expected = ["| `%s` | %s | `%r` | %s |" % (v.name, v.kind, v.default, v.doc) for v in all_variables()]
    assert rows == expected


def test_states_table_lists_every_state():
    text = readme()
    listed = re.findall(r"^\| `(\w+)` \| ", text.split("## Patch states")[1].split("##")[0], re.M)
    assert listed == list(framework.STATES)


def test_readme_gives_exactly_the_two_commands_ci_runs():
    text = readme()
    assert "python3 scripts/demo.py" in text and "python3 scripts/run_tests.py" in text
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as handle:
        ci = [l for l in handle.read().splitlines() if l.strip() and not l.startswith("#")]
    assert ci[-1] == "exec python3 scripts/run_tests.py"
