"""What ``tandem serve`` serves: the modes (which models), the ensembles clients call,
and :class:`ServeOptions`, the settings rendered into each model's ``config.pbtxt``: the
engine's (:class:`~tandem.backends.triton.settings.EngineSettings`, declared there once)
and what only the server decides (which models, under which names).

>>> ServeOptions.of(mode="colocated").ensembles
('tandem_colocated', 'tandem_colocated_direct')
>>> ServeOptions.of(mode="both", ensemble_name="ensemble").aliases
{'ensemble': 'tandem'}
>>> ServeOptions.of(page_size=32).engine.page_size
32
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tandem.backends.speculative.config import AUTO
from tandem.backends.speculative.fit import first_fitting
from tandem.backends.triton.settings import EngineSettings, setting
from tandem.client.paths import DEFAULT_PROPOSERS, DEMO_CHECKPOINTS

log = logging.getLogger("tandem.serve")

# the ensembles clients call, with what each is for (the other models are their steps)
ENSEMBLES = {
    "tandem": "text, disaggregated prefill/decode",
    "tandem_tokens": "token ids, disaggregated prefill/decode",
    "tandem_colocated": "text, colocated (the baseline)",
    "tandem_direct": "text, disaggregated, decode's replies straight out (cancel: the cancel model)",
    "tandem_colocated_direct": "text, colocated, llm's replies straight out (cancel: the cancel model)",
}
# the text ensembles' twins without postprocess (one hop less per token), which the OpenAI
# API streams from; their clients cancel through the "cancel" model
DIRECT = {"tandem": "tandem_direct", "tandem_colocated": "tandem_colocated_direct"}
# the text ensembles' twins that take token ids (the OpenAI API's token-id prompts)
TOKENS = {"tandem": "tandem_tokens"}
COLOCATED = ("preprocess", "llm", "postprocess", "cancel", "tandem_colocated", "tandem_colocated_direct")
PREFILL = ("prefill",)   # a prefill server: decode servers send it jobs (--prefill-endpoints)
# the disaggregated path; "prefill" is no step of its ensembles: kv_transfer hands it jobs
DISAGGREGATED = ("preprocess", "kv_transfer", "prefill", "decode", "postprocess", "cancel", "tandem",
                 "tandem_tokens", "tandem_direct")
# the models each mode serves; "both" puts the two paths side by side for benchmarks
MODES = {
    "disaggregated": DISAGGREGATED,
    "colocated": COLOCATED,
    "both": DISAGGREGATED + tuple(m for m in COLOCATED if m not in DISAGGREGATED),
    "prefill": PREFILL,
}
# the text ensemble of each mode, which --ensemble-name serves under a second name (the
# TensorRT-LLM backend's clients accept only "ensemble" and "tensorrt_llm_bls"); with
# "both", the disaggregated one (tandem_colocated keeps its own name)
TEXT_ENSEMBLE = {"disaggregated": "tandem", "colocated": "tandem_colocated", "both": "tandem"}
_MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


class ServerError(RuntimeError):
    """tritonserver cannot be started as asked (a wrong setting), failed to start, or
    did not become ready."""


@dataclass(slots=True)
class ServeOptions:
    """What ``tandem serve`` puts into the model configs: the engine's settings and the
    models it serves (``engine.model_dir`` "" until the server picks the demo checkpoint)."""

    engine: EngineSettings = field(default_factory=EngineSettings)
    mode: str = setting("disaggregated", "--mode", choices=tuple(MODES), help=(
        "disaggregated (default): the ensembles tandem and tandem_tokens (preprocess, kv_transfer, prefill, "
        "decode and postprocess in their own processes); colocated: the ensemble tandem_colocated "
        "(preprocess, llm, postprocess); both: all of them; prefill: a prefill server for decode servers "
        "started with --prefill-endpoints"))
    ensemble_name: str = setting("", "--ensemble-name", metavar="NAME", help=(
        "also serve the text ensemble (tandem; tandem_colocated with --mode colocated; tandem with --mode "
        "both) under NAME, e.g. ensemble: the name scripts written for the TensorRT-LLM backend call "
        "(default: none)"))
    lora_modules: str = setting("", "--lora-modules", metavar="NAME=DIR,...", help=(
        "LoRA adapters (PEFT directories) served from the start, each under its NAME: the OpenAI model field "
        "or the lora_name input names it; needs --max-loras >= 1; more at run time through the OpenAI API's "
        "/v1/load_lora_adapter (default: none)"))

    @classmethod
    def of(cls, **values) -> "ServeOptions":
        """Options from flat values: ``mode`` and ``ensemble_name`` are this class's, the
        rest :class:`EngineSettings` fields (``ServeOptions.of(mode="both", torch_threads=1)``)."""
        own = {f.name for f in fields(cls)} - {"engine"}
        mine = {k: values.pop(k) for k in list(values) if k in own}
        return cls(EngineSettings(**values), **mine)

    def adapters(self) -> list[tuple[str, str]]:
        """``--lora-modules`` as (name, directory) pairs; a ServerError says what is wrong.

        >>> ServeOptions.of(lora_modules="sql=/a/sql, chat=/a/chat", max_loras=2).adapters()
        [('sql', '/a/sql'), ('chat', '/a/chat')]
        """
        pairs = []
        for item in (i.strip() for i in self.lora_modules.split(",")):
            if not item:
                continue
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ServerError(f"--lora-modules {item!r}: allowed: NAME=DIR, comma-separated")
            pairs.append((name.strip(), path.strip()))
        if pairs and self.engine.max_loras < 1:
            raise ServerError("--lora-modules needs --max-loras >= 1 (the adapter slots each engine holds)")
        return pairs

    @property
    def models(self) -> tuple[str, ...]:
        if self.mode not in MODES:
            raise ServerError(f"mode={self.mode!r}; allowed: {', '.join(MODES)}")
        if self.engine.prefill_endpoints:
            from tandem.backends.triton.prefill_router import parse_endpoints
            if "prefill" not in MODES[self.mode] or self.mode == "prefill":
                raise ServerError(f"--prefill-endpoints is for a decode server (--mode "
                                  f"disaggregated or both), not --mode {self.mode}")
            try:
                parse_endpoints(self.engine.prefill_endpoints)
            except ValueError as e:
                raise ServerError(str(e).replace("prefill_endpoints", "--prefill-endpoints")) from None
            # kv_transfer hands its jobs to the prefill servers: no prefill engine here
            return tuple(m for m in MODES[self.mode] if m != "prefill") + tuple(self.aliases)
        return MODES[self.mode] + tuple(self.aliases)

    @property
    def aliases(self) -> dict[str, str]:
        """``{name: ensemble}``: the mode's text ensemble (:data:`TEXT_ENSEMBLE`) served a
        second time under ``ensemble_name``, the same steps behind both names."""
        name = self.ensemble_name
        if not name:
            return {}
        if self.mode not in TEXT_ENSEMBLE:
            raise ServerError(f"--ensemble-name names a text ensemble; --mode {self.mode} serves none")
        if not _MODEL_NAME.fullmatch(name):
            raise ServerError(f"--ensemble-name {name!r}: allowed: letters, digits, '_', '.' and '-' "
                              "(a model directory name), not starting with '.' or '-'")
        taken = {m for models in MODES.values() for m in models}
        if name in taken:
            raise ServerError(f"--ensemble-name {name!r} is the name of one of Tandem's models; allowed: "
                              f"any other name, e.g. ensemble")
        return {name: TEXT_ENSEMBLE[self.mode]}

    @property
    def ensembles(self) -> tuple[str, ...]:
        return tuple(m for m in self.models if m in ENSEMBLES or m in self.aliases)

    def _check_tensor_parallel(self) -> None:
        """--tp for every engine, --prefill-tp / --decode-tp per role where they differ."""
        engine = self.engine
        if engine.tensor_parallel_size < 1:
            raise ServerError(f"--tp {engine.tensor_parallel_size}; allowed: an integer >= 1")
        for flag, n in (("--prefill-tp", engine.prefill_tensor_parallel_size),
                        ("--decode-tp", engine.decode_tensor_parallel_size)):
            if n < 0:
                raise ServerError(f"{flag} {n}; allowed: an integer >= 1 (or 0: --tp)")
            if n and self.mode == "colocated":
                raise ServerError(f"{flag} with --mode colocated: its one engine prefills and decodes; allowed: "
                                  "--tp")
        if engine.decode_tensor_parallel_size and self.mode == "prefill":
            raise ServerError("--decode-tp with --mode prefill: a prefill server runs no decode engine; allowed: "
                              "--tp or --prefill-tp")

    def template_values(self) -> dict[str, str]:
        engine = self.engine
        self._check_disagg_policy()
        problem = kv_interface_problem(engine.kv_interface, engine.kv_transports)
        if problem:
            raise ServerError(problem)
        if any(c in engine.faults for c in '"\\\n'):
            raise ServerError(f"--faults {engine.faults!r}: quotes, backslashes and line breaks are not allowed")
        self._check_tensor_parallel()
        values = {k: "" if v is None else str(int(v) if isinstance(v, bool) else v)
                  for k, v in asdict(engine).items()}
        values |= {"mode": self.mode, "ensemble_name": self.ensemble_name, "decode_idle_threads": "0",
                   "prefill_idle_threads": "0"}
        if engine.torch_threads == 0 and "prefill" in self.models and self.mode != "prefill":
            # prefill and decode run side by side: a half of the cores each, not all twice
            values["torch_threads"] = str(max(1, (os.cpu_count() or 2) // 2))
            if not engine.prefill_endpoints and not engine.disagg_policy.startswith("remote"):
                # decode prefills too: it takes the prefill process's cores while they idle
                values["decode_idle_threads"] = str(os.cpu_count() or 2)
            # and prefill takes decode's cores while decode holds no sequence: a cold
            # request at low concurrency is prefilled on every core
            values["prefill_idle_threads"] = str(os.cpu_count() or 2)
        values["model_dir"] = str(Path(engine.model_dir).resolve())
        for key, demo in (("draft_model", "draft"), ("mtp_head", "mtp")):
            path = values[key] or (self._default_proposer(key, demo, values["model_dir"])
                                   if self._uses(key) else "")
            values[key] = str(Path(path).resolve()) if path else ""
        return values

    def _default_proposer(self, key: str, demo: str, model_dir: str) -> str:
        """The first default proposer that fits this target (:data:`DEFAULT_PROPOSERS`: the
        SmolLM2 head, then the demo's), or "" where none does and ``--spec auto`` drafts by
        prompt lookup alone; a method named for it gets the demo's, which refuses on load."""
        path, skipped = first_fitting(DEFAULT_PROPOSERS[key], model_dir)
        option = "--" + key.replace("_", "-")
        if path is not None:
            for candidate, misfit in skipped:
                log.info("the default %s %s does not fit the target (%s); using %s", option,
                         candidate, misfit, path)
            return str(path)
        if self.engine.spec_method != AUTO:
            return str(DEMO_CHECKPOINTS / demo)
        for i, (candidate, misfit) in enumerate(skipped):
            log.warning("--spec auto: the default %s %s does not fit the target (%s)%s", option,
                        candidate, misfit, ": drafting by prompt lookup only" if i == len(skipped) - 1 else "")
        return ""

    def _check_disagg_policy(self) -> None:
        from tandem.backends.disagg.routing import RoutingPolicy
        try:
            RoutingPolicy.parse(self.engine.disagg_policy)
        except ValueError as e:
            raise ServerError(str(e).replace("disagg_policy", "--disagg-policy", 1)) from None

    def _uses(self, key: str) -> bool:
        method = self.engine.spec_method
        if method == "auto":   # the MTP head, else the draft: the one given, else the demo head
            method = "draft_target" if self.engine.draft_model and not self.engine.mtp_head else "mtp"
        return (method, key) in (("draft_target", "draft_model"), ("mtp", "mtp_head"))


_UCX_NAMES = re.compile(r"[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*")
_UCX_TLS = re.compile(r"\^?[A-Za-z0-9_:-]+(,[A-Za-z0-9_:-]+)*")


def kv_interface_problem(interface: str, transports: str = "",
                         sys_class: Path = Path("/sys/class")) -> str:
    """What is wrong with ``--kv-interface`` / ``--kv-transports`` ("" if nothing).

    The interface is UCX's ``UCX_NET_DEVICES`` for the KV transfer: network interfaces
    (``eth0``) or RDMA ports (``mlx5_0:1``) of this host's network namespace, comma
    separated, or ``all``; each must exist here. The transports are ``UCX_TLS``
    (``tcp``, ``rc,ud,sm``, ``^cma``).

    >>> kv_interface_problem("lo"), kv_interface_problem("all", "tcp")
    ('', '')
    >>> kv_interface_problem("eth0;rm")
    "--kv-interface 'eth0;rm': allowed: network interfaces or RDMA ports (eth0, mlx5_0:1), comma separated, or all"
    """
    names = interface.strip()
    if names and names != "all":
        if not _UCX_NAMES.fullmatch(names):
            return (f"--kv-interface {interface!r}: allowed: network interfaces or RDMA ports "
                    "(eth0, mlx5_0:1), comma separated, or all")
        for name in names.split(","):
            dev = name.split(":")[0]
            if not ((sys_class / "net" / dev).exists() or (sys_class / "infiniband" / dev).exists()):
                have = sorted(p.name for p in (sys_class / "net").iterdir()) if (sys_class / "net").is_dir() else []
                return (f"--kv-interface {interface!r}: no interface {dev!r} on this host (its network "
                        f"interfaces: {', '.join(have) or 'none'}; RDMA ports are named like mlx5_0:1)")
    tls = transports.strip()
    if tls and tls != "all" and not _UCX_TLS.fullmatch(tls):
        return (f"--kv-transports {transports!r}: allowed: UCX transport names, comma separated "
                "(UCX_TLS: tcp, rc,ud,sm, ^cma), or all")
    return ""
