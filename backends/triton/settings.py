"""Engine settings carried by a model's ``config.pbtxt`` ``parameters``.

``tandem serve`` renders them into the config; Triton hands the config to the
model as JSON (``args["model_config"]``), where each parameter reads
``{"string_value": "..."}``.

>>> cfg = {"parameters": {"model_dir": {"string_value": "/m"}, "page_size": {"string_value": "32"}}}
>>> s = EngineSettings.from_model_config(cfg)
>>> (s.model_dir, s.page_size, s.kv_layout, s.num_pages)
('/m', 32, 'HND', None)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from ..engine.config import ENGINE_DEFAULTS, EngineConfig
from ..speculative.config import (DEFAULT_NUM_SPECULATIVE_TOKENS, NO_SPECULATION,
                                  SpeculativeConfig)

STRING_FIELDS = ("model_dir", "dtype", "kv_layout", "spec_method", "draft_model", "mtp_head",
                 "prefill_endpoints", "kv_interface", "kv_transports", "faults", "disagg_policy")
# environment fallbacks of the KV transfer's settings (a parameter in config.pbtxt wins)
ENV_INTERFACE = "TANDEM_KV_INTERFACE"
ENV_TRANSPORTS = "TANDEM_KV_TRANSPORTS"
ENV_FAULTS = "TANDEM_FAULTS"


@dataclass(slots=True, frozen=True)
class EngineSettings:
    model_dir: str
    dtype: str = ENGINE_DEFAULTS["dtype"]
    page_size: int = ENGINE_DEFAULTS["page_size"]
    num_pages: int | None = None          # None or 0: the engine sizes the pool
    kv_layout: str = ENGINE_DEFAULTS["kv_layout"]
    max_num_seqs: int = ENGINE_DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int = ENGINE_DEFAULTS["max_num_batched_tokens"]
    torch_threads: int = 0                # 0: all cores
    cancel_poll_ms: int = 20              # how often in-flight requests are checked for cancellation
    spec_method: str = NO_SPECULATION     # none | draft_target | mtp
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    draft_model: str = ""
    mtp_head: str = ""
    prefill_endpoints: str = ""           # "host:port,...": prefill servers (prefill forwards)
    # the KV transfer (kv_transfer, prefill, decode)
    kv_interface: str = ""                # UCX network devices; "": $TANDEM_KV_INTERFACE or lo
    kv_transports: str = ""               # UCX transports (UCX_TLS); "": $TANDEM_KV_TRANSPORTS or all
    kv_headroom_pages: int | None = None  # pages reservations leave to running sequences; None: auto
    kv_transfer_timeout_s: int = 10       # a reservation fed nothing this long fails
    kv_drain_s: int = 30                  # an unloading kv_transfer waits this long for its transfers
    faults: str = ""                      # fault injection (rdma/faults.py); "": $TANDEM_FAULTS
    # conditional disaggregation (backends/disagg/routing.py): where kv_transfer sends each
    # prompt; "conditional[:threshold=value,...]" | "remote" | "local"
    disagg_policy: str = "conditional"
    decode_idle_threads: int = 0          # decode's torch threads while prefill idles; 0: torch_threads
    decode_borrow_min_seqs: int = 12      # ... and while its batch holds at least this many sequences
    # decode speed (engine/config.py): 1 = on
    compile: int = 0                      # CPU: decode batches of 1 and 2 through torch.compile
    enforce_eager: int = 0                # GPU: no CUDA graphs
    draft_vocab_size: int = 0             # the proposer scores its N most frequent tokens; 0: all

    @classmethod
    def from_model_config(cls, model_config: dict) -> "EngineSettings":
        params = {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
        if not params.get("model_dir"):
            raise ValueError("config.pbtxt: parameter model_dir is required (a checkpoint directory)")
        values: dict = {}
        for f in fields(cls):
            raw = params.get(f.name, "").strip()
            if not raw or raw.startswith("${"):  # unset, or an unrendered template placeholder
                continue
            if f.name in STRING_FIELDS:
                values[f.name] = raw
                continue
            try:
                values[f.name] = int(raw)
            except ValueError:
                raise ValueError(f"config.pbtxt: parameter {f.name}={raw!r} is not an integer") from None
        s = cls(**values)
        s.check()
        return s

    def check(self) -> None:
        if self.num_pages is not None and self.num_pages < 0:
            raise ValueError(f"config.pbtxt: num_pages={self.num_pages}; allowed: >= 1, or 0 for automatic")
        try:
            self.engine_config().validate()
        except ValueError as e:
            raise ValueError(f"config.pbtxt: {e}") from None
        if self.cancel_poll_ms < 1:
            raise ValueError(f"config.pbtxt: cancel_poll_ms={self.cancel_poll_ms}; allowed: an integer >= 1")
        if self.torch_threads < 0:
            raise ValueError(f"config.pbtxt: torch_threads={self.torch_threads}; allowed: >= 0 (0 = all cores)")
        if self.kv_headroom_pages is not None and self.kv_headroom_pages < 0:
            raise ValueError(f"config.pbtxt: kv_headroom_pages={self.kv_headroom_pages}; allowed: >= 0")
        for name in ("kv_transfer_timeout_s", "kv_drain_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.pbtxt: {name}={getattr(self, name)}; allowed: an integer >= 1")
        if self.decode_borrow_min_seqs < 0:
            raise ValueError(f"config.pbtxt: decode_borrow_min_seqs={self.decode_borrow_min_seqs}; allowed: >= 0")
        if self.decode_idle_threads < 0:
            raise ValueError(f"config.pbtxt: decode_idle_threads={self.decode_idle_threads}; allowed: >= 0 "
                             "(0 = torch_threads)")
        try:
            self.routing_policy()
        except ValueError as e:
            raise ValueError(f"config.pbtxt: {e}") from None
        try:
            self.fault_plan()
        except ValueError as e:
            raise ValueError(f"config.pbtxt: faults: {e}") from None

    @property
    def engine_num_pages(self) -> int | None:
        return self.num_pages or None

    @property
    def threads(self) -> int:
        return self.torch_threads or (os.cpu_count() or 1)

    def speculative(self) -> SpeculativeConfig | None:
        if self.spec_method == NO_SPECULATION:
            return None
        return SpeculativeConfig(self.spec_method, self.num_speculative_tokens,
                                 draft_model=self.draft_model or None, mtp_head=self.mtp_head or None,
                                 draft_vocab_size=self.draft_vocab_size or None)

    def routing_policy(self):
        """Where kv_transfer sends each prompt (:class:`~tandem.backends.disagg.routing.RoutingPolicy`)."""
        from ..disagg.routing import RoutingPolicy
        return RoutingPolicy.parse(self.disagg_policy)

    @property
    def idle_threads(self) -> int:
        """Decode's torch threads while the prefill side has nothing to do."""
        return self.decode_idle_threads or self.threads

    @property
    def net_devices(self) -> str:
        """The UCX network devices the KV transfer uses (loopback unless configured)."""
        return self.kv_interface or os.environ.get(ENV_INTERFACE, "") or "lo"

    @property
    def transports(self) -> str:
        """The UCX transports the KV transfer may use ("": UCX's choice)."""
        return self.kv_transports or os.environ.get(ENV_TRANSPORTS, "")

    def fault_plan(self):
        """The faults to inject (``faults``, else ``$TANDEM_FAULTS``); None: none."""
        from tandem.rdma.faults import Faults
        return Faults.configured(self.faults or os.environ.get(ENV_FAULTS, ""))

    def engine_config(self, **overrides) -> EngineConfig:
        return EngineConfig(self.model_dir, **(self.engine_kwargs() | overrides))

    def engine_kwargs(self) -> dict:
        return dict(dtype=self.dtype, page_size=self.page_size, kv_layout=self.kv_layout,
                    num_pages=self.engine_num_pages, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    speculative=self.speculative(), compile=bool(self.compile),
                    enforce_eager=bool(self.enforce_eager))


def model_limits(model_dir: str) -> tuple[int, int]:
    """``(vocab_size, max_model_len)`` of a checkpoint: what every model on the request
    path checks token ids and lengths against (the engine's context is the checkpoint's
    ``max_position_embeddings``; ``tandem serve`` sets no other)."""
    from tandem.backends.models.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    return cfg.vocab_size, cfg.max_position_embeddings
