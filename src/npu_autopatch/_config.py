"""Configuration from enable() arguments and NPU_AUTOPATCH* environment variables.

Runs at interpreter start when NPU_AUTOPATCH is set, so it uses os and sys only.
Bad values in the environment never raise: they give one warning and a safe choice.
Bad values passed to enable() raise ValueError, because that is a bug in the caller's code.
"""

import os

from ._state import STATE
from ._types import BUILTIN_KERNELS
from .kernels._catalog import SWITCH_DEFAULTS, SWITCHES

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")

ENV_SWITCH = "NPU_AUTOPATCH"
ENV_MODELS = "NPU_AUTOPATCH_MODELS"
ENV_EXCLUDE = "NPU_AUTOPATCH_EXCLUDE"
ENV_KERNELS = "NPU_AUTOPATCH_KERNELS"
ENV_STRICT = "NPU_AUTOPATCH_STRICT"
ENV_LOG_ALL_RANKS = "NPU_AUTOPATCH_LOG_ALL_RANKS"
ENV_DISCOVER = "NPU_AUTOPATCH_DISCOVER"

# The kernels ``kernels=`` / NPU_AUTOPATCH_KERNELS select among; an opt-in kernel (kernels/_catalog)
# has its own switch instead: ``enable(<switch>=True)`` or ``NPU_AUTOPATCH_<SWITCH>=1``.
SELECTABLE_KERNELS = tuple(k for k in BUILTIN_KERNELS if k not in SWITCHES)


def switch_variable(switch):
    """The environment variable of a kernel's switch: ``NPU_AUTOPATCH_<SWITCH>``."""
    return f"{ENV_SWITCH}_{switch.upper()}"


# Long or hostile values are echoed back shortened, never evaluated; a long list of unknown
# names is echoed in part, so that the warning stays one readable line.
_ECHO_LIMIT = 60
_ECHO_NAMES = 5


def echo(value):
    """A safe, short rendering of a user-supplied value for a log line."""
    text = repr(value)
    return text if len(text) <= _ECHO_LIMIT else text[:_ECHO_LIMIT] + "...'"


def parse_bool(name, raw, warn):
    """True/False for a recognised word, None (after one warning) for anything else."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    warn(
        f"ignoring {name}={echo(raw)}: expected one of {'/'.join(TRUE_WORDS)} "
        f"or {'/'.join(w for w in FALSE_WORDS if w)} (or empty)"
    )
    return None


def env_flag(name, warn, environ=None, default=False):
    """An on/off environment variable; unset or unrecognised means ``default`` (off unless said)."""
    raw = (os.environ if environ is None else environ).get(name)
    parsed = None if raw is None else parse_bool(name, raw, warn)
    return default if parsed is None else parsed


def _split_names(raw):
    return [part.strip().lower() for part in raw.split(",") if part.strip()]


def _env_names(environ, name, valid):
    """(the known names, the unknown ones in order) of a comma list from the environment.

    A value with no name in it ("", " ", ",") counts as unset, as an empty NPU_AUTOPATCH
    does: ``NPU_AUTOPATCH_MODELS=$MODELS`` with MODELS unset must not select nothing.
    """
    raw = environ.get(name)
    names = _split_names(raw) if raw is not None else []
    if not names:
        return None, []
    unknown = list(dict.fromkeys(n for n in names if n not in valid))
    return frozenset(n for n in names if n in valid), unknown


def did_you_mean(name, valid):
    """``did you mean 'qwen3'?`` for a wrong name near valid ones (a typo), "" for junk."""
    if len(name) > _ECHO_LIMIT:  # junk, not a typo: not compared with every valid name
        return ""
    import difflib  # only once a name is wrong: it costs ~9 ms (re) at interpreter start

    near = difflib.get_close_matches(name, valid, n=2)
    return f"did you mean {' or '.join(map(repr, near))}?" if near else ""


def _guessed(name, valid):
    """``'qwen33' (did you mean 'qwen3'?)``: a wrong name echoed with the nearest valid ones."""
    hint = did_you_mean(name, valid)
    return f"{echo(name)} ({hint})" if hint else echo(name)


def _unknown_names(name, unknown, valid, what, emptied):
    """The one warning of a list variable with unknown names; ``emptied``: it named nothing else, and
    the selection patches no model."""
    shown = ", ".join(_guessed(n, valid) for n in unknown[:_ECHO_NAMES])
    if len(unknown) > _ECHO_NAMES:
        shown += f" and {len(unknown) - _ECHO_NAMES} more"
    nothing = f"; {name} names no other {what}: no model will be patched" if emptied else ""
    return f"ignoring unknown {what} in {name}: {shown}{nothing}; valid {what}: {', '.join(valid)}"


def _arg_names(value, valid, what, argname):
    if value is None:
        return None
    names = _split_names(value) if isinstance(value, str) else [str(v).strip().lower() for v in value]
    unknown = sorted(set(names) - set(valid))
    if unknown:
        hints = [f"{n!r}: {hint}" for n in unknown if (hint := did_you_mean(n, valid))]
        guesses = f" ({'; '.join(hints)})" if hints else ""
        raise ValueError(
            f"enable({argname}=...): unknown {what} {unknown}{guesses}; valid {what}: {', '.join(valid)}"
        )
    return frozenset(names)


class Config:
    """The resolved selection: which models and kernels, strict or not, forced or not, whether
    modeling modules outside the registry are discovered, and which kernels' own switches are on."""

    __slots__ = ("discover", "exclude", "force", "kernels", "models", "opted_in", "strict")

    # ``opted_in``: the switches that are on, of the built-in kernels and the registered models': an
    # opt-in one turned on (``"loss"``), a switched-on one not turned off (``"step_aside"``).

    def __init__(self, models, exclude, kernels, strict, force, discover=False, opted_in=frozenset()):
        self.models = models  # frozenset, or None for every supported model
        self.exclude = exclude  # frozenset
        self.kernels = kernels  # frozenset, or None for every kernel
        self.strict = strict
        self.force = force
        self.discover = discover
        self.opted_in = frozenset(opted_in)  # the kernels' switches that are on

    def _key(self):
        return (
            self.models,
            self.exclude,
            self.kernels,
            self.strict,
            self.force,
            self.discover,
            self.opted_in,
        )

    def selects(self, kernel):
        """Whether targets of this kernel (a built-in name or a Kernel) are patched: a kernel with a
        switch of its own only while that switch is on."""
        name = getattr(kernel, "name", kernel)
        switch = getattr(kernel, "switch", None) or SWITCHES.get(name)
        if switch is not None:
            return switch in self.opted_in
        return self.kernels is None or name in self.kernels

    def __eq__(self, other):
        return isinstance(other, Config) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def wants(self, model_type):
        """None if the model is selected, else (reason code, why not).

        A model type outside the registry is a discovered one: checked here too, so that a
        discovery planned just before enable(discover=False) never commits.
        """
        if not self.discover and model_type not in STATE.models:
            return "not-selected", "discovery is off"
        if model_type in self.exclude:
            return "excluded", "excluded by configuration"
        switch = _selected_by_switch(model_type)
        if switch is not None:  # e.g. another library's patch giving way to ours: its switch alone
            if switch not in self.opted_in:
                off = f"{switch_variable(switch)}=0 or enable({switch}=False)"
                return "not-selected", f"its switch is off ({off})"
            return None
        if self.models is not None and model_type not in self.models:
            return "not-selected", "not in the selected models"
        return None

    def __repr__(self):
        def show(names):
            return "all" if names is None else ",".join(sorted(names)) or "none"

        # Off: the repr users already know.
        discover = ", discover=True" if self.discover else ""
        defaults = declared_switches()
        switches = "".join(
            f", {switch}={switch in self.opted_in}"
            for switch in sorted(set(defaults) | self.opted_in)
            if (switch in self.opted_in) != defaults.get(switch, False)
        )
        return (
            f"Config(models={show(self.models)}, exclude={show(self.exclude)}, "
            f"kernels={show(self.kernels)}, strict={self.strict}, force={self.force}{discover}{switches})"
        )


def _switch_of(kernel):
    """(its switch or None, on by default) of a Kernel or a built-in kernel's name."""
    if isinstance(kernel, str):
        switch = SWITCHES.get(kernel)
        return switch, SWITCH_DEFAULTS.get(switch, False)
    return getattr(kernel, "switch", None), bool(getattr(kernel, "switched_on", False))


def _selected_by_switch(model_type):
    """The switch that alone selects this entry (its targets all take one switched-on kernel), or None."""
    model = STATE.models.get(model_type)
    switches = {_switch_of(t.kernel) for t in model.targets} if model is not None else set()
    (switch, on), *others = switches or [(None, False)]
    return switch if on and not others else None


def requested_models(models, exclude, environ=None):
    """Every model name the arguments and the environment mention (to look for plugins first)."""
    environ = os.environ if environ is None else environ
    requested = _split_names(f"{environ.get(ENV_MODELS, '')},{environ.get(ENV_EXCLUDE, '')}")
    for names in (models, exclude):
        if names is not None:
            requested += _split_names(names) if isinstance(names, str) else [str(n).lower() for n in names]
    return set(requested)


def discover_wanted(discover, warn, environ=None):
    """enable(discover=...) if given, else NPU_AUTOPATCH_DISCOVER (off when unset)."""
    return bool(discover) if discover is not None else env_flag(ENV_DISCOVER, warn, environ)


def declared_switches():
    """{switch: whether it is on by default} of every kernel with a switch of its own: the built-in
    ones (kernels/_catalog: the loss kernel's off, default_attention's on), then the Kernels the
    registered models name (a plugin's, register()'s, an integration's such as verl's step-aside)."""
    declared = dict(SWITCH_DEFAULTS)
    for model in list(STATE.models.values()):
        for target in model.targets:
            switch = getattr(target.kernel, "switch", None)  # a Kernel's; a built-in name has none
            if switch is not None:
                declared.setdefault(switch, bool(getattr(target.kernel, "switched_on", False)))
    return declared


def opted_in(switches, warn, environ=None):
    """The kernels' switches that are on: ``enable(<switch>=...)`` if given, else NPU_AUTOPATCH_<SWITCH>,
    else the kernel's default (an opt-in kernel off, a switched-on one on). A switch no kernel declares
    raises TypeError, as an unknown keyword would."""
    environ = os.environ if environ is None else environ
    known = declared_switches()
    unknown = sorted(set(switches) - set(known))
    if unknown:
        raise TypeError(
            f"enable() got an unexpected keyword argument {unknown[0]!r} "
            f"(kernel switches: {', '.join(known) or 'none'})"
        )
    on = set()
    for switch, default in known.items():
        value = switches.get(switch)
        if value is None:
            value = env_flag(switch_variable(switch), warn, environ, default=default)
        if value:
            on.add(switch)
    return frozenset(on)


def resolve(
    models, exclude, kernels, strict, force, warn, valid_models, environ=None, discover=False, **switches
):
    """Arguments override the environment; the environment overrides the defaults.

    ``discover``: the already resolved discover_wanted(); ``valid_models`` then includes the
    installed modeling modules' names that the caller found (see _discover.installed).
    ``switches``: the kernels' switches given to enable() (``loss=True``, ``step_aside=False``), see
    opted_in(). ``warn`` is given one line per mistake in the environment, in the order of the
    variables; a selection that patches no model says so once, on the line of the list variable that
    named nothing known (a typo in NPU_AUTOPATCH_MODELS switches every model off), or on a line of its
    own.
    """
    environ = os.environ if environ is None else environ
    valid_models = tuple(valid_models)
    wrong = []  # (variable, its unknown names, the valid ones, what they are, it named nothing known)

    def chosen(value, argname, variable, valid, what):
        names = _arg_names(value, valid, what, argname)
        if names is None:
            names, unknown = _env_names(environ, variable, valid)
            if unknown:
                wrong.append((variable, unknown, valid, what, names == frozenset() and argname != "exclude"))
        return names

    model_set = chosen(models, "models", ENV_MODELS, valid_models, "models")
    exclude_set = chosen(exclude, "exclude", ENV_EXCLUDE, valid_models, "models") or frozenset()
    kernel_set = chosen(kernels, "kernels", ENV_KERNELS, SELECTABLE_KERNELS, "kernels")
    flags = []  # the boolean variables' mistakes, after the lists'
    if strict is None:
        strict = env_flag(ENV_STRICT, flags.append, environ)
    on = opted_in(switches, flags.append, environ)
    config = Config(model_set, exclude_set, kernel_set, bool(strict), bool(force), discover, on)
    nothing = patches_no_model(config)
    for variable, unknown, valid, what, emptied in wrong:
        warn(_unknown_names(variable, unknown, valid, what, emptied and nothing))
    for line in flags:
        warn(line)
    if nothing and not any(emptied for *_, emptied in wrong):
        warn(f"no model will be patched: {config!r} selects none of the known models")
    return config


def patches_no_model(config):
    """Whether the selection leaves out every registered model (an entry its own switch selects, as
    verl's step-aside, aside), so that nothing the user chose will be patched."""
    if config.models is None and config.kernels is None and not config.exclude:
        return False
    if config.discover and config.models is not None and config.models - set(STATE.models):
        return False  # a model type discovery will meet
    for model_type, model in list(STATE.models.items()):
        if config.wants(model_type) is not None or _selected_by_switch(model_type) is not None:
            continue
        if not model.targets or any(config.selects(t.kernel) for t in model.targets):
            return False  # selected (a plugin's targets are known once its module is imported)
    return True
