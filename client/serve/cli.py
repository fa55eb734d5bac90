"""``tandem serve``: start tritonserver on Tandem's model repository and wait for Ctrl-C.

The command line only: its options are generated (``flags``) from the fields of the
settings they fill — :class:`~tandem.backends.triton.settings.EngineSettings`,
:class:`~tandem.client.serve.options.ServeOptions` and
:class:`~tandem.client.serve.triton_server.TritonServer` — with their defaults and help;
only the two that belong to this command alone (the OpenAI port, the drain) are here.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tandem.backends.speculative.config import AUTO, METHODS, SpeculativeConfig
from tandem.backends.speculative.fit import first_fitting
from tandem.backends.triton.settings import EngineSettings

from tandem.client.serve import env_defaults, flags
from tandem.client.paths import DEFAULT_PROPOSERS, DEMO_CHECKPOINTS, DEMO_MODEL
from tandem.client.serve.options import ENSEMBLES, MODES, TEXT_ENSEMBLE, ServeOptions, ServerError
from tandem.client.openai.frontend import DEFAULT_PORT as DEFAULT_OPENAI_PORT
from tandem.client.openai.frontend import FrontendError, start_for
from tandem.client.openai.tool_parsers import TOOL_PARSERS
from tandem.client.serve.triton_server import TritonServer

# below Kubernetes' default grace period (30 s) with room for the server's own stop
DRAIN_TIMEOUT_S = 20.0
HURRY_STOP_S = 2.0   # Ctrl-C: the models' finalize gets this long, then the server is killed
TRITON_PORTS = ("--http-port", "--grpc-port", "--metrics-port")
# the options only some --spec methods read (option: its setting, those methods): set
# with another method they would do nothing
SPEC_OPTIONS = {
    "--k": ("num_speculative_tokens", (*METHODS, AUTO)),
    "--spec-adaptive": ("spec_adaptive", (*METHODS, AUTO)),
    "--draft-model": ("draft_model", ("draft_target", AUTO)),
    "--mtp-head": ("mtp_head", ("mtp", AUTO)),
    "--draft-vocab-size": ("draft_vocab_size", ("draft_target", "mtp", AUTO)),
}
# the proposer checkpoint of a --spec method: its option, setting and demo checkpoint
PROPOSERS = {"draft_target": ("--draft-model", "draft_model", "draft"), "mtp": ("--mtp-head", "mtp_head", "mtp")}
# the dataclasses whose flagged fields are tandem serve's options, and each option's dest
SETTINGS = (EngineSettings, ServeOptions, TritonServer)
DESTS = flags.dests(*SETTINGS)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    # every option defaults to $TANDEM_<OPTION> when that is set (env_defaults; containers)
    p = env_defaults.use(subparsers.add_parser(
        "serve", help="start tritonserver with Tandem's models",
        description="Start tritonserver with Tandem's model repository and wait for Ctrl-C (stop at once) "
                    "or SIGTERM (drain, then stop). Every option defaults to the environment variable "
                    "TANDEM_<OPTION> when that is set (--grpc-port: TANDEM_GRPC_PORT; a flag: 1 or 0); "
                    "the command line wins."), check=check_args)
    # the options are the settings' fields (flags.py): the engine's, what is served, the server's
    for settings in SETTINGS:
        flags.add_flags(p, settings)
    p.add_argument("--openai-port", type=int, default=DEFAULT_OPENAI_PORT,
                   help="port of the OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                        "/v1/models) in front of the text ensembles, on --host (default: %(default)s; 0: off)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="the OpenAI API's /v1/* answers only requests with 'Authorization: Bearer KEY' (401 "
                        "otherwise; /health and /metrics stay open). Prefer TANDEM_API_KEY: a command line is "
                        "visible to every user of the host (default: none, open)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="reads the model's tool calls for the OpenAI API's tool_choice 'auto' (vLLM's names; "
                        "hermes: <tool_call>{...}</tool_call>, Qwen2.5/Hermes templates). Without it 'auto' is "
                        "refused; 'required' and a named function need none (default: none)")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help="on SIGTERM: not ready and no new requests at once, then at most this many seconds "
                        "for the streams in flight to finish before the server stops (default: %(default)s; "
                        "the server's own stop takes up to 15 s more: keep the sum below the orchestrator's "
                        "grace period, e.g. Kubernetes' terminationGracePeriodSeconds). Ctrl-C stops at once")
    p.set_defaults(func=run)


def check_args(args: argparse.Namespace, given: Callable[[str], str]) -> None:
    """Refuse, as the options are parsed and before anything starts, what tritonserver or
    the engine would refuse only once started (or would ignore): a ValueError naming the
    option as ``given`` names it (``--k 20``, or ``TANDEM_K='20' (the default of --k)``).
    """
    for option in ("--page-size", "--max-num-seqs", "--max-num-batched-tokens"):
        if getattr(args, _dest(option)) < 1:
            raise ValueError(f"{given(option)}: must be >= 1")
    for option in ("--num-pages", "--threads"):
        if getattr(args, _dest(option)) < 0:
            raise ValueError(f"{given(option)}: must be >= 0 (0 = automatic)")
    if args.draft_vocab_size < 0:
        raise ValueError(f"{given('--draft-vocab-size')}: must be >= 0 (0 = all tokens)")
    if args.drain_timeout < 0:
        raise ValueError(f"{given('--drain-timeout')}: must be >= 0 (0 = stop at once)")
    _check_ports(args, given)
    _check_prefill_endpoints(args, given)
    _check_speculation(args, given)
    if args.faults:
        from tandem.rdma.faults import ENV, Faults   # imports UCX: only when asked for
        try:
            Faults.parse(args.faults)
        except ValueError as e:
            raise ValueError(f"{given('--faults')}: {str(e).removeprefix(ENV + ': ')}") from None


def _check_ports(args: argparse.Namespace, given: Callable[[str], str]) -> None:
    # Triton takes any int and listens on it mod 65536; 0 would be "pick one" to TritonServer
    for option in TRITON_PORTS:
        if not 1 <= getattr(args, _dest(option)) <= 65535:
            raise ValueError(f"{given(option)}: allowed: 1..65535")
    if not 0 <= args.openai_port <= 65535:
        raise ValueError(f"{given('--openai-port')}: allowed: 1..65535, or 0 (off)")
    # the OpenAI API runs only in front of a text ensemble (not with --mode prefill)
    enabled = TRITON_PORTS + (("--openai-port",) if args.openai_port and args.mode in TEXT_ENSEMBLE else ())
    first: dict[int, str] = {}   # port -> the option that took it
    for option in enabled:
        port = getattr(args, _dest(option))
        if port in first:
            raise ValueError(f"{given(first[port])} and {given(option)}: the same port; "
                             "allowed: a port of its own for each")
        first[port] = option


def _check_prefill_endpoints(args: argparse.Namespace, given: Callable[[str], str]) -> None:
    """This server's own gRPC address as a prefill endpoint would forward its jobs to
    itself: its prefill model waiting on its own prefill model, every request stalled."""
    from tandem.backends.triton.prefill_router import parse_endpoints
    try:
        endpoints = parse_endpoints(args.prefill_endpoints or "")
    except ValueError:
        return   # malformed: ServeOptions refuses it, saying how
    own = {args.host, "127.0.0.1", "localhost", "0.0.0.0", "::1", socket.gethostname()}
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if port == str(args.grpc_port) and host.strip("[]") in own:
            raise ValueError(f"{given('--prefill-endpoints')}: {endpoint} is this server's own gRPC "
                             "address; allowed: prefill servers (tandem serve --mode prefill)")


def _check_speculation(args: argparse.Namespace, given: Callable[[str], str]) -> None:
    method, defaults = args.spec_method, EngineSettings()
    try:   # the engine's own bounds of k (the same for every method; ngram needs no checkpoint)
        SpeculativeConfig("ngram", args.num_speculative_tokens).validate()
    except ValueError as e:
        raise ValueError(f"{given('--k')}: {str(e).partition('; ')[2] or e}") from None
    for option, (name, methods) in SPEC_OPTIONS.items():
        if getattr(args, name) != getattr(defaults, name) and method not in methods:
            needs = " or ".join(filter(None, (", ".join(methods[:-1]), methods[-1])))
            raise ValueError(f"{given(option)}: needs --spec {needs}; with --spec {method} it does nothing")
    if method == AUTO:   # the MTP head, else the draft: the one given, else the demo head
        method = "draft_target" if args.draft_model and not args.mtp_head else "mtp"
    if method not in PROPOSERS:
        return
    option, name, demo = PROPOSERS[method]
    target = DEMO_CHECKPOINTS / "target" if args.model_dir in ("", DEMO_MODEL) else args.model_dir
    fitting = None if getattr(args, name) else first_fitting(DEFAULT_PROPOSERS[name], target)[0]
    if args.spec_method == AUTO and not getattr(args, name) and fitting is None:
        return   # auto skips a default proposer that does not fit the target (said at start)
    checkpoint = Path(getattr(args, name) or fitting or DEMO_CHECKPOINTS / demo)
    what = given(option) if getattr(args, name) else f"{option} (default: {checkpoint})"
    config = checkpoint / "config.json"
    if not config.is_file():
        found = "no config.json in it" if checkpoint.is_dir() else "not a directory"
        raise ValueError(f"{what}: {found}; allowed: a checkpoint directory (config.json, model.safetensors)")
    try:   # the proposer's vocabulary is the target's (checked when it loads)
        vocab_size = int(json.loads(config.read_text())["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{what}: {config} has no vocab_size ({e!r})") from None
    if args.draft_vocab_size > vocab_size:
        raise ValueError(f"{given('--draft-vocab-size')}: more than the model's vocabulary ({vocab_size} "
                         f"tokens, {config}); allowed: 1..{vocab_size}, or 0 (all)")


def _dest(option: str) -> str:
    return DESTS.get(option) or option.lstrip("-").replace("-", "_")


def run(args: argparse.Namespace) -> int:
    options = flags.from_args(ServeOptions, args, engine=flags.from_args(EngineSettings, args))
    server = flags.from_args(TritonServer, args, options=options)
    stop, hurry = threading.Event(), threading.Event()
    phase = ["starting"]

    def on_signal(signum, _frame):
        if phase[0] == "starting":
            raise KeyboardInterrupt  # unwind out of start(); finally stops the server
        if signum == signal.SIGINT or stop.is_set():
            hurry.set()   # Ctrl-C, or a second signal while draining: stop now
        stop.set()  # serving: leave the wait loop; while stopping: already on the way out

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    _log_to_stderr()
    faulthandler.enable(all_threads=True)   # a crash of the frontend leaves its Python stacks
    api = None
    try:
        server.start()
        api = start_for(server, args.openai_port, api_key=args.api_key,    # None when off or nothing to front
                        tool_call_parser=args.tool_call_parser)
        phase[0] = "serving"
        engine = options.engine
        print(f"tandem: serving {engine.model_dir} ({options.mode}), {engine.dtype} "
              f"({engine.dtype_reason or 'asked for'})", flush=True)
        for name in options.ensembles:
            alias_of = options.aliases.get(name)
            what = ENSEMBLES[name] if alias_of is None else f"= {alias_of}, under a TensorRT-LLM client's name"
            print(f"  ensemble {name:<17} {what}")
        if options.ensembles:
            print(f"  HTTP     http://{server.http_url}   (POST /v2/models/{options.ensembles[0]}/generate_stream)")
        else:
            print(f"  HTTP     http://{server.http_url}   (model prefill: decode servers' jobs)")
        print(f"  gRPC     {server.grpc_url}")
        print(f"  metrics  {server.metrics_url}")
        if api is not None:
            key = "; /v1/* requires the API key" if args.api_key else ""
            key += f"; tool calls parsed as {args.tool_call_parser}" if args.tool_call_parser else ""
            print(f"  OpenAI   {api.base_url}   (/completions, /chat/completions, /models; its metrics: /metrics{key})")
        if server.supervise:
            print("  supervised: a dead model is reloaded, a dead server restarted")
        print("Ctrl-C to stop.", flush=True)
        while not stop.is_set():
            if server.failure():
                print(f"tandem: {server.failure()}", file=sys.stderr)
                return 1
            stop.wait(0.5)
        if not hurry.is_set() and args.drain_timeout > 0:   # SIGTERM: an orchestrator's stop
            phase[0] = "draining"
            print(f"tandem: draining: not ready, new requests refused; at most {args.drain_timeout:g} s "
                  "for the streams in flight", flush=True)
            drained = server.drain(args.drain_timeout, abort=hurry)
            print("tandem: drained" if drained else "tandem: streams still in flight; they are cut", flush=True)
        print("tandem: shutting down", flush=True)
        return 0
    except (ServerError, FrontendError) as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tandem: interrupted, shutting down", file=sys.stderr, flush=True)
        return 130
    finally:
        phase[0] = "stopping"
        if api is not None:
            api.stop()
        # Ctrl-C or a second signal: streams still open are cut rather than waited for
        # (tritonserver itself would wait --exit-timeout-secs for them)
        server.cleanup(HURRY_STOP_S if hurry.is_set() else None)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _log_to_stderr() -> None:
    """The supervisor's reports (a dead stub, a reload, its duration) as ``tandem: ...`` lines."""
    import logging

    logger = logging.getLogger("tandem.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("tandem: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
