"""``tandem serve``: start tritonserver on Tandem's model repository and wait for Ctrl-C.

The command line only: the settings are :class:`~tandem.client.serve.options.ServeOptions`
(the options' defaults are its defaults; theirs come from the engine's), the server is
:class:`~tandem.client.serve.triton_server.TritonServer`.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tandem.backends.kv_cache.pages import KV_LAYOUTS
from tandem.backends.models.config import DTYPES
from tandem.backends.speculative.config import METHODS, NO_SPECULATION, SpeculativeConfig

from tandem.client.serve import env_defaults
from tandem.client.paths import DEMO_CHECKPOINTS
from tandem.client.serve.options import ENSEMBLES, MODES, TEXT_ENSEMBLE, ServeOptions, ServerError
from tandem.client.openai.frontend import DEFAULT_PORT as DEFAULT_OPENAI_PORT
from tandem.client.openai.frontend import FrontendError, start_for
from tandem.client.serve.triton_server import TritonServer

# below Kubernetes' default grace period (30 s) with room for the server's own stop
DRAIN_TIMEOUT_S = 20.0
HURRY_STOP_S = 2.0   # Ctrl-C: the models' finalize gets this long, then the server is killed
TRITON_PORTS = ("--http-port", "--grpc-port", "--metrics-port")
# the options only some --spec methods read (option: its setting, those methods): set
# with another method they would do nothing
SPEC_OPTIONS = {
    "--k": ("num_speculative_tokens", METHODS),
    "--draft-model": ("draft_model", ("draft_target",)),
    "--mtp-head": ("mtp_head", ("mtp",)),
    "--draft-vocab-size": ("draft_vocab_size", ("draft_target", "mtp")),
}
# the proposer checkpoint of a --spec method: its option, setting and demo checkpoint
PROPOSERS = {"draft_target": ("--draft-model", "draft_model", "draft"), "mtp": ("--mtp-head", "mtp_head", "mtp")}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    defaults = ServeOptions()
    # every option defaults to $TANDEM_<OPTION> when that is set (env_defaults; containers)
    p = env_defaults.use(subparsers.add_parser(
        "serve", help="start tritonserver with Tandem's models",
        description="Start tritonserver with Tandem's model repository and wait for Ctrl-C (stop at once) "
                    "or SIGTERM (drain, then stop). Every option defaults to the environment variable "
                    "TANDEM_<OPTION> when that is set (--grpc-port: TANDEM_GRPC_PORT; a flag: 1 or 0); "
                    "the command line wins."), check=check_args)
    p.add_argument("--model", dest="model_dir", help="HF checkpoint directory (default: checkpoints/demo/target "
                   "if trained, else an untrained demo checkpoint in .cache/demo-untrained)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--openai-port", type=int, default=DEFAULT_OPENAI_PORT,
                   help="port of the OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                        "/v1/models) in front of the text ensembles, on --host (default: %(default)s; 0: off)")
    p.add_argument("--dtype", choices=DTYPES, default=defaults.dtype)
    p.add_argument("--page-size", type=int, default=defaults.page_size,
                   help="tokens per KV page (default: %(default)s)")
    p.add_argument("--num-pages", type=int, default=defaults.num_pages,
                   help="KV pages in the pool (default: %(default)s = automatic)")
    p.add_argument("--kv-layout", choices=KV_LAYOUTS, default=defaults.kv_layout)
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                   help="sequences per batch (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                   help="tokens per step (default: %(default)s)")
    p.add_argument("--threads", type=int, default=defaults.torch_threads,
                   help="torch threads of each engine process (default: %(default)s = all cores; "
                        "disaggregated: half each for prefill and decode)")
    p.add_argument("--spec", dest="spec_method", choices=(NO_SPECULATION, *METHODS), default=defaults.spec_method,
                   help="speculative decoding method (default: %(default)s)")
    p.add_argument("--k", dest="num_speculative_tokens", type=int, default=defaults.num_speculative_tokens,
                   help="draft tokens per step with --spec (default: %(default)s)")
    p.add_argument("--draft-model", default=defaults.draft_model,
                   help="draft checkpoint (default: checkpoints/demo/draft)")
    p.add_argument("--mtp-head", default=defaults.mtp_head, help="MTP head checkpoint (default: checkpoints/demo/mtp)")
    p.add_argument("--draft-vocab-size", type=int, default=defaults.draft_vocab_size, metavar="N",
                   help="with --spec draft_target or mtp: the proposer scores only its N most frequent "
                        "tokens (token_frequencies.json in its checkpoint; lossless, only acceptance "
                        "changes) (default: %(default)s = all)")
    p.add_argument("--compile", action="store_true", default=defaults.compile,
                   help="CPU: decode batches of 1 and 2 through torch.compile (~5-10 s of compiling per "
                        "batch size and context bucket on first use; bf16 greedy text can differ from "
                        "the eager engine's at near-ties)")
    p.add_argument("--enforce-eager", action="store_true", default=defaults.enforce_eager,
                   help="GPU: run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--prefill-endpoints", default=defaults.prefill_endpoints,
                   help="host:port,... gRPC endpoints of prefill servers (`tandem serve --mode "
                        "prefill`) that this decode server sends its prefills to (default: its own)")
    p.add_argument("--disagg-policy", default=defaults.disagg_policy, metavar="POLICY",
                   help="where a disaggregated server prefills each prompt: conditional (default: short "
                        "prompts, or all while the prefill side is busy, in decode's own batch; long ones "
                        "on the prefill side), remote (always the prefill side), local (always decode); "
                        "thresholds as conditional:local_prompt_tokens=256,max_prefill_wait_ms=1000,"
                        "prefill_tokens_per_s=5000,max_local_prefill_tokens=2048")
    p.add_argument("--kv-interface", default=defaults.kv_interface, metavar="IFACE[,IFACE...]",
                   help="network devices the KV cache travels on between prefill and decode servers "
                        "(UCX_NET_DEVICES of the KV transfer): an interface (eth0), an RDMA port "
                        "(mlx5_0:1; needs a UCX built with verbs: the wheel's has none, so set "
                        "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true to load the system's), comma separated, "
                        "or all (default: lo, i.e. one host only)")
    p.add_argument("--kv-transports", default=defaults.kv_transports, metavar="TLS",
                   help="UCX transports the KV transfer may use (UCX_TLS), e.g. tcp: TCP only, no "
                        "shared memory or CMA even where UCX sees one host (network namespaces, "
                        "containers); rc,ud,sm with RDMA (default: UCX's choice)")
    p.add_argument("--mode", choices=tuple(MODES), default=defaults.mode,
                   help="disaggregated (default): the ensembles tandem and tandem_tokens (preprocess, "
                        "kv_transfer, prefill, decode and postprocess in their own processes); colocated: "
                        "the ensemble tandem_colocated (preprocess, llm, postprocess); both: all of them; "
                        "prefill: a prefill server for decode servers started with --prefill-endpoints")
    p.add_argument("--ensemble-name", default=defaults.ensemble_name, metavar="NAME",
                   help="also serve the text ensemble (tandem; tandem_colocated with --mode colocated; "
                        "tandem with --mode both) under NAME, e.g. ensemble: the name scripts written for "
                        "the TensorRT-LLM backend call (default: none)")
    p.add_argument("--model-control-mode", choices=("none", "explicit"), default="explicit",
                   help="explicit (default): every model loaded at start, Triton's repository API open "
                        "(load/unload models, roll versions; the supervisor reloads a dead model through "
                        "it); none: a fixed repository (the supervisor can only restart the server)")
    p.add_argument("--no-supervise", dest="supervise", action="store_false",
                   help="do not watch the model processes: a dead stub stays dead (debugging)")
    p.add_argument("--faults", default=defaults.faults, metavar="SPEC",
                   help="fault injection for tests and benchmarks, passed to the models (config "
                        "parameter `faults`, env TANDEM_FAULTS), e.g. 'transfer_fail=0.05@mid_layers,"
                        "seed=1'; format: rdma/faults.py (default: off)")
    p.add_argument("--tritonserver", default="", metavar="PATH",
                   help="the tritonserver (2.51) binary to run, e.g. /opt/tritonserver/bin/tritonserver in "
                        "NVIDIA's Triton container (default: the one in the nvidia-pytriton wheel)")
    p.add_argument("--run-dir", type=Path, help="where the rendered repository and backend go (default: a temp dir)")
    p.add_argument("--log-file", type=Path, help="write tritonserver's log here instead of the terminal")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness (default: 300)")
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
    method, defaults = args.spec_method, ServeOptions()
    try:   # the engine's own bounds of k (the same for every method; ngram needs no checkpoint)
        SpeculativeConfig("ngram", args.num_speculative_tokens).validate()
    except ValueError as e:
        raise ValueError(f"{given('--k')}: {str(e).partition('; ')[2] or e}") from None
    for option, (name, methods) in SPEC_OPTIONS.items():
        if getattr(args, name) != getattr(defaults, name) and method not in methods:
            needs = " or ".join(filter(None, (", ".join(methods[:-1]), methods[-1])))
            raise ValueError(f"{given(option)}: needs --spec {needs}; with --spec {method} it does nothing")
    if method not in PROPOSERS:
        return
    option, name, demo = PROPOSERS[method]
    checkpoint = Path(getattr(args, name) or DEMO_CHECKPOINTS / demo)
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
    return option.lstrip("-").replace("-", "_")


def run(args: argparse.Namespace) -> int:
    options = ServeOptions(
        model_dir=args.model_dir, dtype=args.dtype, page_size=args.page_size, num_pages=args.num_pages,
        kv_layout=args.kv_layout, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, torch_threads=args.threads,
        spec_method=args.spec_method, num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model, mtp_head=args.mtp_head, mode=args.mode,
        prefill_endpoints=args.prefill_endpoints, faults=args.faults, ensemble_name=args.ensemble_name,
        disagg_policy=args.disagg_policy, kv_interface=args.kv_interface,
        kv_transports=args.kv_transports, draft_vocab_size=args.draft_vocab_size,
        compile=args.compile, enforce_eager=args.enforce_eager,
    )
    server = TritonServer(options, run_dir=args.run_dir, host=args.host, http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port, log_file=args.log_file,
                          log_verbose=args.log_verbose, ready_timeout_s=args.ready_timeout,
                          model_control_mode=args.model_control_mode, supervise=args.supervise,
                          tritonserver=args.tritonserver)
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
    api = None
    try:
        server.start()
        api = start_for(server, args.openai_port)   # None when off or nothing to front
        phase[0] = "serving"
        print(f"tandem: serving {options.model_dir} ({options.mode})", flush=True)
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
            print(f"  OpenAI   {api.base_url}   (/completions, /chat/completions, /models; its metrics: /metrics)")
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
