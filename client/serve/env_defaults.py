"""Option defaults from the environment: ``--grpc-port`` defaults to ``$TANDEM_GRPC_PORT``,
``--prefill-endpoints`` to ``$TANDEM_PREFILL_ENDPOINTS`` — ``TANDEM_`` and the long option
name, upper case, ``-`` as ``_``. A flag on the command line wins over the variable.

Containers and orchestrators configure ``tandem serve`` this way (docker/entrypoint.sh).
A value is converted and checked as argparse checks the option (its type, its choices);
a flag (``--no-supervise``) takes 1/true/yes/on or 0/false/no/off. A bad value ends the
command with an error that names the variable, and so does one the command's own check
refuses (``use(parser, check=...)``, before the command runs; its messages name the
variable through ``given``). A ``TANDEM_*`` variable that is no option's (a typo) is
warned about on stderr (:func:`unknown_variables`), not ignored silently:

>>> env = {"TANDEM_GRPC_PORT": "9001", "TANDEM_NO_SUPERVISE": "true"}
>>> p = EnvDefaultsParser(prog="demo", environ=env)
>>> _ = p.add_argument("--grpc-port", type=int, default=8001)
>>> _ = p.add_argument("--no-supervise", dest="supervise", action="store_false")
>>> vars(p.parse_args([])), vars(p.parse_args(["--grpc-port", "7"]))
({'grpc_port': 9001, 'supervise': False}, {'grpc_port': 7, 'supervise': False})
>>> env_var("--kv-interface")
'TANDEM_KV_INTERFACE'
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Mapping

PREFIX = "TANDEM_"
# TANDEM_* variables read for another purpose than an option's default, by the code named:
# never warned about as unknown (KV_INTERFACE, KV_TRANSPORTS and FAULTS are options' too)
OTHER_VARIABLES = frozenset({
    "TANDEM_DEBUG",            # client/cli.py: a user error's traceback
    "TANDEM_PACKED_WEIGHTS",   # backends/models/packed_linear.py: 0 turns packed weights off
    "TANDEM_CPU_KERNELS",      # backends/cpu_kernels: 0 turns the C++ kernels off
    "TANDEM_KERNEL_CACHE_DIR",  # backends/cpu_kernels: where they are built
    "TANDEM_CACHE_DIR",        # backends/models/model_path.py: where converted GGUFs are cached
    "TANDEM_FAULTS",           # rdma/faults.py: the models' fault injection
    "TANDEM_KV_INTERFACE",     # backends/triton/settings.py: the KV transfer's fallbacks
    "TANDEM_KV_TRANSPORTS",
    "TANDEM_HOPS_KEEP",        # client/bench/hops.py: keep a run's files; the stubs' code shim
    "TANDEM_HOPS_SHIM",
})
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def env_var(option: str, prefix: str = PREFIX) -> str:
    """The variable holding the default of ``option`` (a long option string)."""
    return prefix + option.lstrip("-").upper().replace("-", "_")


# check(args, given): raises ValueError with what is wrong; given(option) is how the user
# gave that option's value (EnvDefaultsParser.given), for the message
Check = Callable[[argparse.Namespace, Callable[[str], str]], None]


class EnvDefaultsParser(argparse.ArgumentParser):
    """An ArgumentParser whose long options default to ``TANDEM_<OPTION>`` when that is set
    (read from ``environ``, ``os.environ`` when None, each time it parses), and whose parsed
    arguments pass ``check`` (else it exits with usage and status 2, as argparse does)."""

    def __init__(self, *args, environ=None, check: Check | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.environ, self.check = environ, check

    def parse_known_args(self, args=None, namespace=None):
        environ = getattr(self, "environ", None)   # None too when made as another class (use())
        self.parsed_environ = os.environ if environ is None else environ
        for warning in unknown_variables(self, self.parsed_environ):
            print(f"{self.prog}: warning: {warning}", file=sys.stderr)
        apply_env_defaults(self, self.parsed_environ)
        namespace, extras = super().parse_known_args(args, namespace)
        check = getattr(self, "check", None)
        if check is not None and not extras:   # extras: the caller reports them first
            try:
                check(namespace, lambda option: self.given(namespace, option))
            except ValueError as e:
                self.error(str(e))
        return namespace, extras

    def given(self, namespace: argparse.Namespace, option: str) -> str:
        """``option``'s value as the user gave it, for a message: ``--k 20``, or
        ``TANDEM_K='20' (the default of --k)`` when it came from the environment."""
        action = self._option_string_actions[option]   # argparse's own option -> action map
        value = getattr(namespace, action.dest)
        var, environ = env_var(option), getattr(self, "parsed_environ", {})
        if var in environ and value == action.default:   # the variable's (or the same on the line)
            return f"{var}={environ[var]!r} (the default of {option})"
        return f"{option} {value!r}" if isinstance(value, str) else f"{option} {value}"


def use(parser: argparse.ArgumentParser, check: Check | None = None) -> argparse.ArgumentParser:
    """Make ``parser`` (a subcommand's, which argparse builds with its own class) an
    :class:`EnvDefaultsParser` whose parsed arguments pass ``check``."""
    parser.__class__ = EnvDefaultsParser
    parser.check = check
    return parser


def unknown_variables(parser: argparse.ArgumentParser, environ: Mapping[str, str], prefix: str = PREFIX,
                      other: frozenset[str] = OTHER_VARIABLES) -> list[str]:
    """What to warn about: each ``prefix*`` variable in ``environ`` that is neither an
    option's nor in ``other``, with the closest option's variable.

    >>> p = argparse.ArgumentParser(prog="demo")
    >>> _ = p.add_argument("--grpc-port")
    >>> unknown_variables(p, {"TANDEM_GRPC_PROT": "9001", "TANDEM_DEBUG": "1", "TANDEM_GRPC_PORT": "1"})
    ['TANDEM_GRPC_PROT is no option of demo and is ignored; did you mean TANDEM_GRPC_PORT (--grpc-port)?']
    """
    options = {env_var(o, prefix): o for a in parser._actions for o in a.option_strings
               if o.startswith("--") and not isinstance(a, argparse._HelpAction)}
    warnings = []
    names = {var.removeprefix(prefix): var for var in options}   # compared without the prefix all share
    for var in sorted(v for v in environ if v.startswith(prefix) and v not in options and v not in other):
        close = [names[n] for n in difflib.get_close_matches(var.removeprefix(prefix), names, n=1)]
        hint = (f"did you mean {close[0]} ({options[close[0]]})?" if close
                else f"each --option reads {prefix}<OPTION> (see --help)")
        warnings.append(f"{var} is no option of {parser.prog} and is ignored; {hint}")
    return warnings


def apply_env_defaults(parser: argparse.ArgumentParser, environ, prefix: str = PREFIX) -> None:
    """Set the default of each of ``parser``'s long options whose variable is set."""
    for action in parser._actions:   # argparse has no public list of a parser's options
        option = next((o for o in action.option_strings if o.startswith("--")), None)
        if option is None or isinstance(action, argparse._HelpAction):
            continue
        # the default the option was declared with, kept for the next parse
        declared = action.__dict__.setdefault("declared_default", action.default)
        var = env_var(option, prefix)
        action.default = _convert(parser, action, option, var, environ[var]) if var in environ else declared


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, option: str, var: str, raw: str):
    if action.nargs == 0:   # a flag: store_true / store_false / store_const
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            parser.error(f"{var}={raw!r} (the default of {option}, a flag): allowed: "
                         f"{'/'.join(_TRUE)} to set it, {'/'.join(_FALSE[:-1])} or empty not to")
        return action.const if word in _TRUE else action.declared_default
    try:
        value = action.type(raw) if action.type is not None else raw
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        kind = getattr(action.type, "__name__", "value")
        parser.error(f"{var}={raw!r} (the default of {option}): not a valid {kind}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"{var}={raw!r} (the default of {option}): allowed: "
                     f"{', '.join(map(str, action.choices))}")
    return value
