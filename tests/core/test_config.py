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


URL_RULE = ("expected tcp://HOST:PORT with a port in 1..65535, e.g. tcp://10.0.0.1:6789 (HOST: a hostname, "
            "IPv4 or [IPv6] address; ASCII digits)")


@pytest.mark.parametrize("raw", [
    "tcp://10.0.0.1:1",
    "tcp://node-1.cluster:65535",
    "tcp://[1:2:3:4:5:6:7:8]:6789",      # a full IPv6 address: no last character is spare
    "tcp://[fe80::1%eth0]:6789",          # with a scope
    "tcp://[fe80::1%Eth_0.1-x]:00080",   # a scope of letters of either case, digits and _.-
])
def test_a_url_with_a_hostname_or_an_address_and_a_port_in_1_to_65535_is_read_as_given(raw):
    assert URL.read({URL.name: raw}) == raw
    assert URL.read({URL.name: "  %s\t" % raw}) == raw  # blanks around it are dropped


@pytest.mark.parametrize("raw", [
    "tcp://h:0", "tcp://h:65536", "tcp://h:99999",   # out of 1..65535
    "tcp://h:000001",                                # six digits, even of a port in range
    "tcp://h:12a", "tcp://h:", "tcp://h:\u0661\u0662",  # not ASCII digits
    "http://h:1", "tcp://h", "tcp://h:1:2",          # not tcp://HOST:PORT
    "tcp://999.0.0.1:1", "tcp://1.2.3:1",            # digits and dots, but no IPv4 address
    "tcp://-node.x:1", "tcp://a..b:1", "tcp://n\u00e9.x:1",  # no RFC 1123 label
    "tcp://[::g]:1", "tcp://[10.0.0.1]:1",           # no IPv6 address
    "tcp://[fe80::1%e$h]:1", "tcp://[fe80::1%]:1", "tcp://[fe80::1%a%b]:1",  # no scope
])
def test_a_url_that_is_not_tcp_host_port_says_what_it_expects(raw):
    assert error(URL, raw) == "NPU_SHIM_TEST_URL=%r is invalid: %s" % (raw, URL_RULE)


def test_the_parsers_made_by_mib_and_url_carry_their_name_kind_default_and_doc():
    """Made in the test (not at import), as a patch module makes its own."""
    size = config.mib("NPU_SHIM_TEST_MIB", "a size of MiB", zero_means="turns it off")
    plain = config.mib("NPU_SHIM_TEST_PLAIN", "a size")
    address = config.url("NPU_SHIM_TEST_ADDRESS", "an address")
    assert (size.name, size.kind, size.default, size.doc, size.aliases) == (
        "NPU_SHIM_TEST_MIB", "MiB", 0, "a size of MiB", ())
    assert (address.name, address.kind, address.default, address.doc) == (
        "NPU_SHIM_TEST_ADDRESS", "url", "", "an address")
    assert size.read({}) == 0 and size.read({"NPU_SHIM_TEST_MIB": "64"}) == 64
    assert address.read({}) == "" and address.read({"NPU_SHIM_TEST_ADDRESS": "tcp://h:1"}) == "tcp://h:1"
    assert error(size, "-1") == ("NPU_SHIM_TEST_MIB='-1' is invalid: expected a whole number of MiB >= 0 "
                                 "(0 turns it off)")
    assert error(plain, "-1") == "NPU_SHIM_TEST_PLAIN='-1' is invalid: expected a whole number of MiB >= 0"
    assert error(address, "x") == "NPU_SHIM_TEST_ADDRESS='x' is invalid: " + URL_RULE


@pytest.mark.parametrize("raw, value", [
    ("1", True), (" TRUE ", True), ("Yes", True), ("on", True),
    ("0", False), ("false", False), (" NO", False), ("Off\t", False),
])
def test_a_boolean_takes_its_words_in_any_case(raw, value):
    flag = config.boolean("NPU_SHIM_TEST_BOOL", None, "a flag")
    assert flag.read({"NPU_SHIM_TEST_BOOL": raw}) is value


def test_a_boolean_that_is_no_word_says_which_words_it_takes():
    assert error(FLAG, "maybe") == ("NPU_SHIM_TEST_FLAG='maybe' is invalid: expected a boolean: one of 1/0, "
                                    "true/false, yes/no, on/off")


def test_a_switch_is_on_by_default_and_named_after_its_patch():
    switch = config.switch("my_patch", "my doc", aliases=("NPU_SHIM_MINE",))
    assert (switch.name, switch.kind, switch.default, switch.doc, switch.aliases) == (
        "NPU_SHIM_MY_PATCH", "bool", True, "my doc", ("NPU_SHIM_MINE",))
    assert switch.read({}) is True and switch.read({"NPU_SHIM_MINE": "off"}) is False


def test_the_log_level_and_format_take_their_words_in_any_case_and_name_them_otherwise():
    assert config.LOG_LEVEL.read({}) == "INFO" and config.LOG_FORMAT.read({}) == "text"
    assert config.LOG_LEVEL.read({"NPU_SHIM_LOG_LEVEL": " debug "}) == "DEBUG"
    assert config.LOG_FORMAT.read({"NPU_SHIM_LOG_FORMAT": " JSON "}) == "json"
    assert error(config.LOG_LEVEL, "verbose") == (
        "NPU_SHIM_LOG_LEVEL='verbose' is invalid: expected one of DEBUG, INFO, WARNING, ERROR")
    assert error(config.LOG_FORMAT, "xml") == "NPU_SHIM_LOG_FORMAT='xml' is invalid: expected one of text, json"


def test_the_allow_list_is_patch_names_separated_by_commas():
    assert config.PATCHES.read({}) is None
    assert config.PATCHES.read({"NPU_SHIM_PATCHES": " zbal , mla_weight_release,"}) == ("zbal", "mla_weight_release")
    for raw in (" , ", "zbal,unknown"):
        assert error(config.PATCHES, raw) == (
            "NPU_SHIM_PATCHES=%r is invalid: expected patch names separated by commas, out of: zbal, "
            "mla_weight_release, dual_stream_experts" % raw)


def test_read_all_gives_each_variable_its_value_or_its_error():
    assert config.read_all([FLAG, SIZE], {"NPU_SHIM_TEST_FLAG": "0", "NPU_SHIM_TEST_SIZE": "12G"}) == {
        "NPU_SHIM_TEST_FLAG": (False, None),
        "NPU_SHIM_TEST_SIZE": (None, "NPU_SHIM_TEST_SIZE='12G' is invalid: expected a whole number of MiB, "
                                     "e.g. 12288 for 12 GiB (no unit suffix; ASCII digits)")}


def test_without_an_environ_the_process_environment_is_read(monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith(config.SWITCH_PREFIX)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NPU_SHIM_OLD_FLAG", "0")
    monkeypatch.setenv("NPU_SHIM_TEST_SIZE", "-5")
    monkeypatch.setenv("NPU_SHIM_TEST_FLGA", "1")
    monkeypatch.setenv("NPU_SHIM_QQQQQQQQQQQQQQQQQQQQ", "1")
    assert FLAG.read() is False and FLAG.is_set() and FLAG.name_set() == "NPU_SHIM_OLD_FLAG"
    with pytest.raises(config.ConfigError) as info:
        SIZE.read()
    assert str(info.value) == ("NPU_SHIM_TEST_SIZE='-5' is invalid: expected a whole number of MiB >= 0 "
                               "(0 turns zbal off)")
    assert config.unknown_names([FLAG, SIZE]) == [
        ("NPU_SHIM_QQQQQQQQQQQQQQQQQQQQ", None), ("NPU_SHIM_TEST_FLGA", "NPU_SHIM_TEST_FLAG")]
    assert config.unknown_names([FLAG, SIZE], {"NPU_SHIM_TEST_SIZE": "1"}) == []


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
