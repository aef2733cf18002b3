"""The exit codes of ``python -m npu_shim``, and the rule every command applies to the variables.

One code for each thing an operator does differently: fix the command line, fix the variables, fix
the job before it starts (it would stop), read the one line that says what is wrong, or look
elsewhere (nothing here to check).  What each code means for each command is listed once, in
docs/operations.md ("Exit codes").
"""

from npu_shim.core import config, framework

EXIT_BAD_ENV = 2
EXIT_STRICT = 3
EXIT_PROBLEM = 4      # check, selftest or bundle found a problem (the output says which)
EXIT_UNAVAILABLE = 5  # nothing to check here: no sglang, no device, or the device is busy
EXIT_USAGE = 64
EXIT_BROKEN_PIPE = 141  # as a shell reports a writer killed by SIGPIPE


def stood_down_variables(patches, states):
    """The names of upstream's variables (not ``NPU_SHIM_*``) that only patches in state
    ``upstream`` read: the running sglang reads them itself, its own way, and the shim does not
    judge them.  ``states``: {patch name: state}."""
    def upstream_vars(patch):
        return {var.name for var in patch.reads if not var.name.startswith(config.SWITCH_PREFIX)}

    ours = set().union(*[upstream_vars(p) for p in patches if states.get(p.name) == framework.UPSTREAM])
    others = set().union(*[upstream_vars(p) for p in patches if states.get(p.name) != framework.UPSTREAM])
    return ours - others


def states_here():
    """{patch name: state} as ``status`` decides them in this interpreter (sglang's source read from
    disk, nothing imported); {} without sglang."""
    from npu_shim.core.loading import load_all
    from npu_shim.source.codeview import SourceView
    from npu_shim.source.reading import find_package_dir

    package_dir = find_package_dir("sglang")
    if package_dir is None:
        return {}
    view = SourceView(package_dir)
    return {patch.name: framework.decide(patch, view).state for patch in load_all()}


def config_exit_code(states, stops=False):
    """EXIT_BAD_ENV for an invalid variable or an ``NPU_SHIM_*`` name the shim does not read;
    EXIT_STRICT when a server would stop at import: strict mode is on and a patch is
    ``unsupported`` or ``failed`` (``inactive``: nothing to do, is fine), or ``stops`` (a patch
    the job asks for explicitly cannot apply); else 0.  The same rule for ``status`` and ``check``.
    ``states``: {patch name: state}; a variable of upstream's that only ``upstream`` patches read
    is sglang's to judge, not the shim's (``stood_down_variables``)."""
    from npu_shim.core.loading import all_variables, load_all

    patches = load_all()
    variables = all_variables(patches)
    values = config.read_all(variables)
    stood_down = stood_down_variables(patches, states)
    if any(error for name, (_value, error) in values.items() if name not in stood_down) \
            or config.unknown_names(variables):
        return EXIT_BAD_ENV
    if stops or (values[config.STRICT.name][0] and any(state in framework.PROBLEMS for state in states.values())):
        return EXIT_STRICT  # in a server the process stops at import, as the check process did
    return 0
