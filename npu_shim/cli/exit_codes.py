"""The exit codes of ``python -m npu_shim``, and the rule every command applies to the variables.

What each code means for each command is listed once, in docs/operations.md ("Exit codes").
"""

from npu_shim.core import config, framework

EXIT_BUNDLE_FAILED = 1
EXIT_BAD_ENV = 2
EXIT_STRICT = 3
EXIT_CHECK_FAILED = 4
EXIT_NO_SGLANG = 5
# 6 and 7 were ``status --running``'s (retired with the state records): not reused.
EXIT_NPU_STACK = 8
EXIT_SELFTEST_FAILED = 9
EXIT_SELFTEST_REFUSED = 10
EXIT_NO_DEVICE = 11
EXIT_USAGE = 64
EXIT_BROKEN_PIPE = 141  # as a shell reports a writer killed by SIGPIPE


def config_exit_code(states, stops=False):
    """EXIT_BAD_ENV for an invalid variable or an ``NPU_SHIM_*`` name the shim does not read;
    EXIT_STRICT when a server would stop at import: strict mode is on and a patch is
    ``unsupported`` or ``failed`` (``inactive``: nothing to do, is fine), or ``stops`` (a patch
    the job asks for explicitly cannot apply); else 0.  The same rule for ``status`` and ``check``."""
    from npu_shim.core.loading import all_variables

    variables = all_variables()
    values = config.read_all(variables)
    if any(error for _value, error in values.values()) or config.unknown_names(variables):
        return EXIT_BAD_ENV
    if stops or (values[config.STRICT.name][0] and any(state in framework.PROBLEMS for state in states)):
        return EXIT_STRICT  # in a server the process stops at import, as the check process did
    return 0
