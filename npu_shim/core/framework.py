"""The patch model: what a patch declares and how it is decided (nothing is changed here).

A patch is a module found from its name (docs/adding-a-patch.md), ``npu_shim/patches/<name>.py``:

* ``PATCH``, an instance of a ``Patch`` subclass -- the thin contract, all that deciding needs:
  ``upstream`` (the PR it backports, the release that has it, the releases it backports to),
  its ``switch``, the variables it ``reads``, the ``modules`` it hooks, and three methods:
  ``probe`` (upstream's own implementation in the running code), ``trigger`` (nothing to do in
  this job) and ``targets``; optionally ``must_honour``, its own ``error`` and a ``Report``
  (what it says about itself in ``check`` and the summary line);
* ``targets(view, ctx)`` (npu_shim/runtime/targets.py) and what its wrappers share in a process,
  called only where the patch is decided past its probe and trigger;
* optionally, ``npu_shim/patches/_selftest/<name>.py``: its step of ``python -m npu_shim selftest``.

The declaration is checked when the class is defined, and every target against ``modules`` when
the patch is decided.  ``decide`` turns it into one of the states below from the sglang *source*
(``codeview.SourceView``), before anything is changed; the runtime then applies the targets.
"""

import re
import sys

from npu_shim.core import config

APPLIED = "applied"          # backported into the running sglang
UPSTREAM = "upstream"        # stood down: the running sglang has the feature itself
DISABLED = "disabled"        # switched off (its switch, NPU_SHIM_PATCHES or NPU_SHIM_ENABLED)
INACTIVE = "inactive"        # nothing to do here: trigger not set, no NPU, no such code path
UNSUPPORTED = "unsupported"  # should apply but cannot: a target's code is not what the shim knows
FAILED = "failed"            # an error: bad configuration, a broken declaration, applying raised
STATES = (APPLIED, UPSTREAM, DISABLED, INACTIVE, UNSUPPORTED, FAILED)
PROBLEMS = (UNSUPPORTED, FAILED)  # the states strict mode refuses

_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
_RELEASE = re.compile(r"[0-9]+(\.[0-9]+)+\Z")


class SourceError(ValueError):
    """A source file the shim cannot decode or parse (one line: which file and why); the source
    reader (npu_shim/source/codeview.py) raises it, and it leaves the patch that asked
    ``unsupported``."""


def version_tuple(text):
    """'0.5.10.post1' -> (0, 5, 10); unknown text -> ()."""
    numbers = []
    for part in (text or "").split("."):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)


class Verdict(Exception):
    """How a patch's decision ends other than ``applied``: raised from anywhere in ``trigger`` or
    ``targets`` with the reason (the one way a patch says "not here")."""

    state = None

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class Inactive(Verdict):
    """This sglang or job has nothing for the patch to do."""

    state = INACTIVE


class Unsupported(Verdict):
    """The patch should apply but cannot here (code it does not know)."""

    state = UNSUPPORTED


class Failed(Verdict):
    """The job asks for the patch but it cannot work as configured."""

    state = FAILED


class ShimError(RuntimeError):
    """Raised to the application only in strict mode, or when a feature the user explicitly
    configured cannot be honoured (running without it would be silently wrong)."""


class Report:
    """What a patch says about itself beyond its state -- all optional, none of it needed to
    decide or apply (the core and the commands name no patch: they ask this)."""

    def check_facts(self):
        """{report key: {"label", "text", ...}}: what ``python -m npu_shim check`` shows about the
        image for this patch (read from files; nothing is imported or initialised)."""
        return {}

    def summary(self, details):
        """The words the summary line adds after this patch's state (``applied(full, 49152
        MiB)``); ``details``: a ``Details`` reader of this process's record."""
        return []


class Details:
    """Typed readers of a patch record's details (what its wrappers keep): each returns the value
    only when it has the type asked for, else None."""

    def __init__(self, details):
        self._details = details if isinstance(details, dict) else {}

    def text(self, key, limit=None):
        value = self._details.get(key)
        return value[:limit] if isinstance(value, str) else None  # limit None: all of it

    def count(self, key):
        """A non-negative int (never a bool)."""
        value = self._details.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    def number(self, key):
        """An int or a float (never a bool)."""
        value = self._details.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class Upstream:
    """Where a patch comes from and when it goes (vllm-ascend's registry: why, how, PR, when to
    remove): the upstream ``pr`` it backports, the first sglang ``release`` that has it, and the
    releases it is backported to, ``backports = (first, last)``, which must end before
    ``release``.  The patch can be removed once every supported image runs ``release``."""

    def __init__(self, pr, release, backports):
        self.pr, self.release, self.backports = pr, release, tuple(backports)

    @property
    def remove_when(self):
        return "every supported image runs sglang >= %s" % self.release

    def __str__(self):
        return "backport of %s; upstream since %s" % (self.pr, self.release)

    def problems(self):
        """What is wrong with it ([] when nothing)."""
        if not (isinstance(self.pr, str) and self.pr):
            return ["upstream.pr is required (e.g. sgl-project/sglang#19246)"]
        releases = list(self.backports) + [self.release]
        if len(self.backports) != 2 or not all(isinstance(r, str) and _RELEASE.match(r) for r in releases):
            return ["upstream.backports must be (first, last) and upstream.release a release number"]
        if not version_tuple(releases[0]) <= version_tuple(releases[1]) < version_tuple(releases[2]):
            return ["upstream.backports %s - %s must end before upstream.release %s" % tuple(releases)]
        return []


class Patch:
    """The contract (OpenTelemetry's instrumentor, for a backport): four facts and three methods.

    A feature module ``npu_shim/patches/<name>.py`` subclasses it; the patch's name is the
    module's, its title the first line of the module's docstring."""

    upstream = None        # an Upstream: the PR, the release that has it, the releases backported to
    switch = None          # its switch's doc (NPU_SHIM_<NAME> is made from it), or the config.EnvVar
                           # given outright (config.switch(name, doc, aliases=older names, still read))
    reads = ()             # the other config.EnvVar it depends on; a bad value fails the patch (one
                           # of upstream's where sglang has the feature: upstream reads it)
    modules = ()           # every sglang module its targets can live in (hooks are put on these)

    # Optional, each with a default that fits most patches:
    error = ShimError      # what the process raises when a requested patch cannot be honoured
    report = Report()      # what it says about itself in check and the summary line

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__module__.rpartition(".")[2]
        if isinstance(cls.__dict__.get("switch"), str) and _NAME.match(cls.name):
            cls.switch = config.switch(cls.name, cls.switch)
        problems = declaration_problems(cls)
        if problems:
            raise TypeError("patch %s is declared wrongly: %s" % (cls.__name__, "; ".join(problems)))

    @property
    def title(self):
        """One line: what it does -- its module docstring's first line (less a leading '<name>: ')."""
        doc = getattr(sys.modules.get(type(self).__module__), "__doc__", None) or ""
        line = doc.strip().partition("\n")[0].strip()
        prefix = self.name + ": "
        return (line[len(prefix):] if line.startswith(prefix) else line).rstrip(".")

    def probe(self, view):
        """Evidence (a short string) that the running sglang already has the feature, else None."""
        raise NotImplementedError

    def trigger(self, environ, on_npu):
        """Raise ``Inactive(reason)`` when the patch has nothing to do in this job.  By default:
        off an NPU (``on_npu`` False; None is "not known").  A patch that overrides it calls this
        one too, unless it also works without an NPU."""
        if on_npu is False:
            raise Inactive("not running on an NPU (torch.npu is unavailable)")

    def targets(self, view, ctx):
        """The Wrap/Replace targets for this release (``ctx``: a DecideContext): the patch
        module's ``targets(view, ctx)``, which raises a ``Verdict`` (``Inactive``,
        ``Unsupported``, ``Failed``) where there are none to apply."""
        module = sys.modules.get(type(self).__module__)
        function = getattr(module, "targets", None)
        if not callable(function):
            raise NotImplementedError("patch %s's module %s defines no targets(view, ctx)"
                                      % (self.name, type(self).__module__))
        return function(view, ctx)

    def must_honour(self, environ):
        """True when the user explicitly asked for the feature, so that failing to apply it must
        stop the process rather than run silently without it (optional)."""
        return False


def declaration_problems(cls):
    """What is wrong with a Patch subclass's declaration ([] when nothing)."""
    problems = []
    if not _NAME.match(cls.name or ""):
        problems.append("name %r is not a lower-case identifier" % (cls.name,))
    if not isinstance(cls.switch, config.EnvVar):
        problems.append("switch must be its doc (a string) or a config.EnvVar (config.switch(name, doc))")
    elif cls.switch.name != config.switch_name(cls.name):
        problems.append("switch is %s, expected %s" % (cls.switch.name, config.switch_name(cls.name)))
    if not all(isinstance(var, config.EnvVar) for var in cls.reads):
        problems.append("reads must hold config.EnvVar only")
    if not isinstance(cls.upstream, Upstream):
        problems.append("upstream must be an Upstream(pr, release, backports=(first, last))")
    else:
        problems += cls.upstream.problems()
    if not cls.modules or not all(m.startswith("sglang.") for m in cls.modules):
        problems.append("modules must list the sglang modules its targets live in")
    return problems


def expected_state(patch, version):
    """The state the patch's declaration promises on ``version`` with its trigger set and its
    switch on: ``upstream`` from upstream.release, ``applied`` in upstream.backports, ``inactive``
    before it (no code to backport onto), ``unsupported`` between the range and upstream."""
    key = version_tuple(version)
    if key >= version_tuple(patch.upstream.release):
        return UPSTREAM
    first, last = (version_tuple(r) for r in patch.upstream.backports)
    if key < first:
        return INACTIVE
    return APPLIED if key[:len(last)] <= last else UNSUPPORTED


class DecideContext:
    """What ``targets(view, ctx)`` may consult and say while the patch is being decided."""

    def __init__(self, environ, assume_triggered, details=None):
        self.environ = environ                    # None: os.environ (as EnvVar.read takes it)
        self.assume_triggered = assume_triggered  # "would it apply if switched on?"
        self.details = {} if details is None else details  # the record's: status shows them
        # What the patch's wrappers share in this process (what they set up and count), set by
        # ``targets``: made once per decision, so uninstall()/install() starts over; the record
        # keeps it (tests and the demo reach it).
        self.process_state = None
        self.notes = []                           # appended to the ``applied`` reason

    def note(self, text):
        self.notes.append(text)


class Decision:
    def __init__(self, state, reason, targets=(), details=None, process_state=None):
        self.state = state
        self.reason = reason
        self.targets = list(targets)
        self.details = {} if details is None else details
        self.process_state = process_state

    def __repr__(self):
        return "Decision(%s: %s)" % (self.state, self.reason)


def switched_off(patch, environ=None):
    """Why the patch is ``disabled`` (master switch, allow-list, its own switch), else None."""
    if not config.ENABLED.read(environ):
        return "%s=0" % config.ENABLED.name
    allowed = config.PATCHES.read(environ)
    if allowed is not None and patch.name not in allowed:
        return "not in %s" % config.PATCHES.name
    if not patch.switch.read(environ):
        return "%s=0" % patch.switch.name_set(environ)
    return None


def decide(patch, view, environ=None, on_npu=None, assume_triggered=False):
    """The patch's state for this sglang source and environment; changes nothing.

    ``on_npu`` None means "not known" (static use: the status command, the release matrix);
    ``assume_triggered`` skips the trigger, NPU included (to ask "would it apply if switched on,
    on an NPU?").
    """
    try:
        off = switched_off(patch, environ)
        if off:
            return Decision(DISABLED, off)
        if getattr(patch, "broken", None):
            return Decision(FAILED, patch.broken)
        for var in patch.reads:
            try:
                var.read(environ)
            except config.ConfigError as exc:
                return _invalid(patch, view, var, exc)
    except config.ConfigError as exc:
        return Decision(FAILED, str(exc))
    if view is None:
        return Decision(UNSUPPORTED, "sglang not found")
    try:
        return _decide_from_source(patch, view, environ, on_npu, assume_triggered)
    except SourceError as exc:  # a file the patch reads does not decode or parse
        return Decision(UNSUPPORTED, str(exc))
    except Verdict as verdict:
        return Decision(verdict.state, verdict.reason)


def _invalid(patch, view, var, exc):
    """A variable the patch reads that the backport cannot accept: ``failed`` -- unless it is
    upstream's (not ``NPU_SHIM_*``) and this sglang has the feature: upstream reads its own
    variables its own way, and the shim, standing down, neither checks nor vetoes them."""
    if view is not None and not var.name.startswith(config.SWITCH_PREFIX):
        try:
            evidence = patch.probe(view)
        except SourceError:
            evidence = None
        if evidence:
            return Decision(UPSTREAM, "sglang %s has it: %s; upstream reads %s itself (to the backport, %s)"
                            % (view.version or "?", evidence, var.name, exc))
    return Decision(FAILED, str(exc))


def _decide_from_source(patch, view, environ, on_npu, assume_triggered):
    evidence = patch.probe(view)
    if evidence:
        return Decision(UPSTREAM, "sglang %s has it: %s" % (view.version or "?", evidence))
    if not assume_triggered:
        patch.trigger(environ, on_npu)
    ctx, targets = targets_for(patch, view, environ, assume_triggered)
    stray = sorted({t.module for t in targets} - set(patch.modules))
    if stray:
        return Decision(FAILED, "declaration error: targets in %s, which %s.modules does not list "
                                "(no hook would apply them)" % (", ".join(stray), type(patch).__name__))
    problems = [p for p in (t.check_source(view) for t in targets) if p]
    if problems:
        return Decision(UNSUPPORTED, "; ".join(problems))
    reason = str(patch.upstream) + (" (%s)" % "; ".join(ctx.notes) if ctx.notes else "")
    return Decision(APPLIED, reason, targets, ctx.details, ctx.process_state)


def targets_for(patch, view, environ=None, assume_triggered=True):
    """(ctx, targets) as a decision lists them.  Raises a ``Verdict`` where the patch has none to
    apply here."""
    ctx = DecideContext(environ, assume_triggered)
    return ctx, patch.targets(view, ctx)


def without_wrapt(decision, reason):
    """A patch that would apply cannot where wrapt is missing: it is ``failed`` with the reason."""
    if decision.state != APPLIED:
        return decision
    return Decision(FAILED, "%s (use an npu-shim bundle: 'python -m npu_shim bundle DIR', or "
                            "install wrapt>=1.14 in the image)" % reason)
