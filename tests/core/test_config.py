"""npu_shim/core/config.py in process: each parser's boundaries and messages, and what an EnvVar says
about itself.  Every variable against hostile values, through ``status``: test_hostile_inputs.py;
switches and the allow-list: test_framework.py."""
from __future__ import annotations

import pytest

from npu_shim.core import config

SIZE = config.mib("NPU_SHIM_TEST_SIZE", "a test size", zero_means="turns zbal off")
URL = config.url("NPU_SHIM_TEST_URL", "a test url")
FLAG = config.boolean("NPU_SHIM_TEST_FLAG", True, "a test flag", aliases=("NPU_SHIM_OLD_FLAG",))


def error(var, raw):
    with pytest.raises(config.ConfigError) as info:
        var.read({var.name: raw})
    return str(info.value)


@pytest.mark.parametrize("raw, message", [
    ("-5", "expected a whole number of MiB >= 0 (0 turns zbal off)"),
    (" -0 ", "expected a whole number of MiB >= 0 (0 turns zbal off)"),
    ("-x", "expected a whole number of MiB, e.g. 12288 for 12 GiB (no unit suffix; ASCII digits)"),
    ("12G", "expected a whole number of MiB, e.g. 12288 for 12 GiB (no unit suffix; ASCII digits)"),
    ("1048577", "expected at most 1048576 MiB (1 TiB, more than any NPU holds)"),
    ("0000000000001", "expected at most 1048576 MiB (1 TiB, more than any NPU holds)"),  # 13 digits
])
def test_a_size_that_is_not_a_whole_number_of_mib_says_which_rule_it_broke(raw, message):
    assert error(SIZE, raw) == "NPU_SHIM_TEST_SIZE=%r is invalid: %s" % (raw, message)


def test_sizes_up_to_the_limit_are_read_as_mib():
    for raw, value in (("0", 0), (" 12288 ", 12288), ("1048576", 1 << 20), ("000000000001", 1)):
        assert SIZE.read({SIZE.name: raw}) == value
    assert SIZE.read({}) == 0 and SIZE.read({SIZE.name: "  "}) == 0


def test_a_host_name_may_have_253_characters_and_no_more():
    name = ".".join(["a" * 63] * 3 + ["b" * 61])  # 4 labels of at most 63: 253 characters
    assert len(name) == 253
    assert URL.read({URL.name: "tcp://%s:1" % name}) == "tcp://%s:1" % name
    assert "is invalid: expected tcp://HOST:PORT" in error(URL, "tcp://%s:1" % (name + "c"))


def test_a_value_is_shown_whole_up_to_60_characters_then_cut():
    exactly = "x" * 60
    assert error(SIZE, exactly) == "NPU_SHIM_TEST_SIZE=%r is invalid: expected a whole number of MiB, " \
                                   "e.g. 12288 for 12 GiB (no unit suffix; ASCII digits)" % exactly
    assert error(SIZE, exactly + "y").startswith("NPU_SHIM_TEST_SIZE=%r... is invalid:" % exactly)


def test_is_set_follows_the_name_or_an_alias_with_a_non_blank_value():
    assert FLAG.is_set({"NPU_SHIM_TEST_FLAG": "0"}) is True
    assert FLAG.is_set({"NPU_SHIM_OLD_FLAG": "0"}) is True
    assert FLAG.is_set({"NPU_SHIM_TEST_FLAG": " "}) is False and FLAG.is_set({}) is False
    assert FLAG.name_set({"NPU_SHIM_OLD_FLAG": "1", "NPU_SHIM_TEST_FLAG": "0"}) == "NPU_SHIM_TEST_FLAG"


def test_an_env_var_reads_as_its_name():
    assert repr(FLAG) == "EnvVar(NPU_SHIM_TEST_FLAG)"
    assert (FLAG.kind, SIZE.kind, URL.kind, URL.default) == ("bool", "MiB", "url", "")


def test_the_bootstrap_spells_booleans_as_the_config_does():
    """The bootstrap keeps its own copy of the words (it imports nothing of the shim at start-up)."""
    from npu_shim import _bootstrap

    assert (_bootstrap.TRUE_WORDS, _bootstrap.FALSE_WORDS) == (config.TRUE_WORDS, config.FALSE_WORDS)


@pytest.mark.parametrize("raw, ok", [
    ("/dev/shm/npu-shim", True),
    ("/" + "a" * 255, True),
    ("/" + "a" * 256, False),                      # a name longer than NAME_MAX
    ("/" + "/".join(["d" * 200] * 20), True),      # 4020 bytes
    ("/" + "/".join(["d" * 200] * 21), False),     # 4221 bytes: past what open(2) takes
    ("/x/\udcff" * 1400, False),                  # undecodable bytes count as the bytes they are
])
def test_a_state_dir_every_reader_can_open(raw, ok):
    """The writer walks the directory one folder at a time, so before the fix it made a path of
    any length -- one ``status --running`` could not open (ENAMETOOLONG)."""
    if ok:
        assert config.STATE_DIR.read({config.STATE_DIR.name: raw}) == raw
    else:
        assert error(config.STATE_DIR, raw).endswith("expected a path of at most 4095 bytes, each name at most 255")


# -- property: every variable's value, whatever it is -----------------------------------------------

from hypothesis import given, strategies as st  # noqa: E402 - the property tests' imports, beside them

from npu_shim.core.loading import all_variables  # noqa: E402 - the property tests' imports, beside them
from npu_shim.reporting.terminal import printable  # noqa: E402 - the property tests' imports, beside them

# Values as the environment can hand them over: any text, with the lone surrogates Python makes of
# bytes that are no UTF-8, and the shapes the parsers look for (digits, URLs, paths, lists).
VALUES = st.one_of(
    st.text(),
    st.binary(max_size=64).map(lambda raw: raw.decode("utf-8", "surrogateescape")),
    st.from_regex(r"\A\s*[-+]?[0-9０-９]{0,25}\s*\Z"),
    st.from_regex(r"\Atcp://[\w.\[\]:%-]{0,40}\Z"),
    st.from_regex(r"\A/[\w./-]{0,80}\Z"),
    st.lists(st.sampled_from(["zbal", "mla_weight_release", "dual_stream_experts", "", " ", "x"]))
    .map(",".join),
)


@given(index=st.integers(min_value=0), raw=VALUES)
def test_every_variable_parses_any_value_or_says_why_in_one_line(index, raw):
    """The parser of each variable: its value, or ConfigError naming the variable -- never another
    exception -- and a message a UTF-8 terminal takes once escaped."""
    variables = all_variables()
    var = variables[index % len(variables)]
    try:
        value = var.read({var.name: raw})
    except config.ConfigError as exc:
        text = printable(exc)
        assert var.name in text and "\n" not in text
        text.encode("utf-8")
    else:
        assert value is None or isinstance(value, (bool, int, str, tuple, list, frozenset))
