"""Option defaults from the environment: ``--grpc-port`` defaults to ``$TANDEM_GRPC_PORT``,
``--prefill-endpoints`` to ``$TANDEM_PREFILL_ENDPOINTS`` — ``TANDEM_`` and the long option
name, upper case, ``-`` as ``_``. A flag on the command line wins over the variable.

Containers and orchestrators configure ``tandem serve`` this way (docker/entrypoint.sh).
A value is converted and checked as argparse checks the option (its type, its choices);
a flag (``--no-supervise``) takes 1/true/yes/on or 0/false/no/off. A bad value ends the
command with an error that names the variable:

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
import os

PREFIX = "TANDEM_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def env_var(option: str, prefix: str = PREFIX) -> str:
    """The variable holding the default of ``option`` (a long option string)."""
    return prefix + option.lstrip("-").upper().replace("-", "_")


class EnvDefaultsParser(argparse.ArgumentParser):
    """An ArgumentParser whose long options default to ``TANDEM_<OPTION>`` when that is set
    (read from ``environ``, ``os.environ`` when None, each time it parses)."""

    def __init__(self, *args, environ=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.environ = environ

    def parse_known_args(self, args=None, namespace=None):
        environ = getattr(self, "environ", None)   # None too when made as another class (use())
        apply_env_defaults(self, os.environ if environ is None else environ)
        return super().parse_known_args(args, namespace)


def use(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` (a subcommand's, which argparse builds with its own class) an
    :class:`EnvDefaultsParser`."""
    parser.__class__ = EnvDefaultsParser
    return parser


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
