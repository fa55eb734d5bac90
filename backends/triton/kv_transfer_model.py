"""The ``kv_transfer`` model: the decode node's transfer engine.

It creates (or maps) the server's shared decode pool and runs a
:class:`~tandem.rdma.KVReceiver` on it. Per request it reserves un-evictable pages for
``input_ids[:-1]`` plus the context blob, draws the reservation's secret, arms its
counter, and returns the destination descriptor (``kv_descriptor``) for prefill;
receives run on the receiver's own thread. An unclaimed or unfed reservation is
reclaimed by lease.

It is the gate before any page is reserved: it checks the whole token request with
the parser ``decode`` uses (:func:`parse_token_request`), and that the request can ever
fit the pool (prompt + ``max_tokens``: INVALID_ARG) and that its structured-output
guide compiles (xgrammar's reason: INVALID_ARG), so a request that decode would
refuse never holds pages. A pool that is merely full answers UNAVAILABLE ("retry
later").

With prefix caching it looks each prompt up in decode's cache (kept in the shared pool,
:mod:`tandem.rdma.pool_cache`): a remote reservation shares the cached prefix and gets
fresh pages only for the rest, which is all prefill sends (the descriptor's
``first_page``); routing counts only the tokens decode lacks.

It also decides where each prompt is prefilled (conditional disaggregation,
:mod:`tandem.backends.disagg.routing`): from the prompt's uncached length, the prefill side's
backlog (the pool's reservations still waiting for KV, whether a local prefill process
or remote prefill servers feed them) and decode's own prefill backlog (its load board).
A request routed ``local`` reserves nothing: its descriptor is the no-transfer sentinel,
and decode prefills it in its batch. A request routed ``remote`` is handed to the prefill
side here (:mod:`.prefill_handoff`: this server's ``prefill`` model, which is no step of
the ensembles, or the prefill servers of ``--prefill-endpoints``); when the prefill side
takes no job (dead, restarting, hung) its reservation is given back and the prompt goes to
decode after all (``prefill_down``), as every long prompt does until the prefill side is
worth another try. The ``tandem_disagg_requests_total{path, reason}`` metric counts the
decisions.

Unloading (a version roll or a reload) drains: the old instance takes no new
reservations, keeps receiving for the ones in flight until they are claimed or fail
(at most ``kv_drain_s``), then closes; the new instance attaches to the same pool.
"""
from __future__ import annotations

import json
import time

import numpy as np

import triton_python_backend_utils as pb_utils

from ..engine.prefix_caching import key_lookahead, prompt_page_keys
from ..engine.request_limits import LimitError, check_pool_fit, lookahead_slots
from ..kv_cache.pages import pages_needed
from .disagg_common import KV_DESCRIPTOR, LOCAL, NO_TRANSFER, as_bytes_tensor, pool_spec
from .generate_request import RequestError, as_request_error, check_guide, parse_token_request
from .inputs import input_getter
from .lora_requests import adapter_entry
from .metrics import Poller, TransferMetrics
from .per_request import PerRequestModel, error_response
from .settings import EngineSettings, model_limits


class TritonPythonModel(PerRequestModel):
    def initialize(self, args: dict) -> None:
        from tandem.backends.disagg import open_or_create, shard_scheme
        from tandem.rdma import KVReceiver, ReceiverConfig

        name, version = args.get("model_name", "kv_transfer"), str(args.get("model_version", "1"))
        s = EngineSettings.from_model_config(json.loads(args["model_config"]))
        self.settings = s
        self.adapters = s.adapters()     # the server's LoRA adapter registry (None: no LoRA)
        self.pool = open_or_create(pool_spec(s))
        # the prefill side's split of the KV heads: every transfer is planned from it to
        # the pool's (decode's), and the receiver counts the writes both make
        self.prefill_scheme = shard_scheme(self.pool.spec.models[0].num_kv_heads, s.prefill_tp)
        self.context_nbytes = self.pool.spec.context_bytes
        self.page_size = self.pool.spec.models[0].page_size
        self.lookahead = lookahead_slots(s.speculative())
        self.key_lookahead = key_lookahead(s.speculative())
        self.metrics = TransferMetrics(name, version)
        config = ReceiverConfig(timeout_s=float(s.kv_transfer_timeout_s),
                                net_devices=s.net_devices, transports=s.transports,
                                faults=s.fault_plan())
        self.receiver = KVReceiver(self.pool, config, name="kv_transfer",
                                   on_ready=self.metrics.on_ready)
        self.metrics_poller = Poller(lambda: self.metrics.poll_receiver(self.receiver.stats, self.pool))
        self.vocab_size, self.max_model_len = model_limits(s.model_dir)
        self.policy = s.routing_policy()
        self.decode_board = None   # opened once decode has created it
        from tandem.backends.disagg.decode_load import InTransit
        self.in_transit = InTransit()
        self.guides = None    # a GuideCompiler, made on the first guided request
        from .prefill_handoff import prefill_side_for
        self.prefill_down_until = 0.0   # time.monotonic(): long prompts stay in decode until then
        self.prefill = prefill_side_for(s, on_down=self._prefill_down)
        if s.prefill_endpoints:
            pb_utils.Logger.log_info(f"[kv_transfer] prefilling on {', '.join(self.prefill.endpoints)} "
                                     f"({s.prefill_routing})")
        if config.faults is not None:
            pb_utils.Logger.log_warn(f"[kv_transfer] fault injection is on: {config.faults}")

    def respond(self, request):
        from tandem.rdma import PoolExhausted

        get = input_getter(request)

        try:
            parsed = parse_token_request(get, self.vocab_size, self.max_model_len)
            n = len(parsed.prompt)
            self._check_fits(n, parsed.max_tokens, parsed.num_return_sequences)
            check_guide(parsed, self._compile_guide)   # before a page is reserved
            adapter = adapter_entry(parsed, self.adapters)   # one the server does not serve, too
        except RequestError as e:
            return error_response(str(e), pb_utils.TritonError.INVALID_ARG)
        keys = self._cache_keys(parsed.prompt, parsed.cache_salt, adapter)
        # a request for its prompt's log-probabilities computes its whole prompt
        cached = self.pool.cache_lookup(keys) * self.page_size \
            if keys and parsed.num_prompt_log_probs is None else 0
        route = self._route(n, parsed.num_return_sequences, cached,
                            prompt_logits=parsed.num_prompt_log_probs is not None)
        desc = NO_TRANSFER
        if route.path != LOCAL:
            try:
                reservation = self.receiver.reserve(n - 1, self.prefill_scheme,
                                                    context_nbytes=(self.context_nbytes,), cached_keys=keys)
            except PoolExhausted as e:
                return error_response(
                    f"the decode KV pool is full ({e}); retry later", pb_utils.TritonError.UNAVAILABLE)
            except ValueError as e:
                return error_response(str(e), pb_utils.TritonError.INVALID_ARG)
            try:
                route, desc = self._hand_off(parsed.prompt, reservation, route, parsed.cache_salt,
                                             None if adapter is None else adapter.name)
            except ValueError as e:   # the prefill side refused the job: it does not fit there
                return error_response(f"prefill: {e}", pb_utils.TritonError.INVALID_ARG)
        self.metrics.routed(route.path, route.reason)
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(KV_DESCRIPTOR, as_bytes_tensor(desc))])

    def _hand_off(self, prompt: list[int], reservation, route, cache_salt: str | None,
                  lora_name: str | None = None):
        """Give the prefill side the job of ``reservation``: the route and descriptor
        decode gets — the reservation's, or, when the prefill side took no job, none
        (the reservation given back) and decode prefills the prompt (``prefill_down``)."""
        from tandem.backends.disagg.routing import Route
        from .prefill_router import PrefillUnavailable

        desc = reservation.to_bytes()
        try:
            self.prefill.submit(np.asarray(prompt, dtype=np.int32), as_bytes_tensor(desc), cache_salt, lora_name)
        except ValueError:   # the prefill side refused this job itself
            self.receiver.cancel(reservation.slot, reservation.generation)
            raise
        except Exception as e:   # noqa: BLE001 - unavailable, or the hand-off itself broke
            self.receiver.cancel(reservation.slot, reservation.generation)
            if not isinstance(e, PrefillUnavailable):
                pb_utils.Logger.log_error(f"[kv_transfer] handing a job to the prefill side failed: "
                                          f"{type(e).__name__}: {e}: prefilled in decode")
            elif e.tried:   # (while it is skipped, every prompt is prefilled in decode unsaid)
                pb_utils.Logger.log_warn(f"[kv_transfer] {e}: prefilled in decode meanwhile")
            # decode's backlog grows by what it lacks of the prompt (routing counts it)
            self.in_transit.add(len(prompt) - reservation.first_page * self.page_size, time.monotonic())
            return Route(LOCAL, "prefill_down"), NO_TRANSFER
        return route, desc

    def _prefill_down(self, until_s: float | None) -> None:
        """The prefill side took no job and is not worth another try before ``until_s``
        (``time.monotonic()``; None: it takes jobs again)."""
        self.prefill_down_until = until_s or 0.0

    def _compile_guide(self, guide):
        """Compile (and cache) a guide as decode will: a bad one is refused here, before
        a page is reserved for it."""
        if self.guides is None:
            from tandem.backends.engine.guided import GuideCompiler
            from tandem.backends.models.tokenizer import generation_eos_ids, load_tokenizer
            from tandem.backends.models.config import ModelConfig

            s = self.settings
            eos = [*ModelConfig.from_dir(s.model_dir).eos_token_ids, *generation_eos_ids(s.model_dir)]
            self.guides = GuideCompiler(load_tokenizer(s.model_dir), self.vocab_size, eos)
        return self.guides.compile(guide)

    def _cache_keys(self, prompt: list[int], cache_salt: str | None, adapter=None) -> list[bytes]:
        """The prompt's page keys as decode's prefix cache keys them ([] while no decode
        owns the pool's cache, or caching is off); ``adapter``: the request's LoRA adapter
        (its registry entry: the name and files the keys are made of)."""
        root = self.pool.cache_root() if self.pool.caching else None
        if root is None:
            return []
        return prompt_page_keys(prompt, self.page_size, root, cache_salt, self.key_lookahead, adapter)

    def _route(self, prompt_len: int, num_sequences: int, cached_tokens: int = 0,
               prompt_logits: bool = False):
        """Where this prompt is prefilled: here in decode, or by the prefill side.
        Decode's backlog counts what it has taken in, plus what was routed to it and
        has not arrived yet; of the prompt, only what decode has not cached."""
        from tandem.backends.disagg.decode_load import DecodeLoadBoard
        from tandem.backends.disagg.routing import DecodeLoad, PrefillLoad, choose_path

        if self.decode_board is None:
            self.decode_board = DecodeLoadBoard.open_if_exists(self.pool.spec.name)
        requests, pages = self.pool.backlog()
        down = time.monotonic() < self.prefill_down_until
        prefill = PrefillLoad(requests, pages * self.pool.spec.models[0].page_size, down)
        decode, now = DecodeLoad(), time.monotonic()
        if self.decode_board is not None:
            in_transit = self.in_transit.observe(*self.decode_board.taken_in(), now)
            decode = DecodeLoad(self.decode_board.read().prefill_tokens + in_transit)
        route = choose_path(prompt_len, prefill, decode, self.policy, cached_tokens, prompt_logits)
        # decode prefills every sample itself but the remote path's first one
        here = num_sequences - (route.path != LOCAL)
        if here:
            self.in_transit.add((prompt_len - cached_tokens) * here, now)
        return route

    def _check_fits(self, prompt_len: int, max_tokens: int, num_sequences: int = 1) -> None:
        """Refuse what the pool can never hold (decode would refuse it after the
        prefill): every sample's whole sequence in the pool, its prompt in one reservation."""
        spec, page_size = self.pool.spec, self.pool.spec.models[0].page_size
        try:
            need = check_pool_fit(prompt_len, max_tokens, page_size, spec.num_pages,
                                  self.lookahead, pool="decode pool")
        except LimitError as e:
            raise as_request_error(e) from None
        if need * num_sequences > spec.num_pages:
            raise RequestError("num_return_sequences", f"{num_sequences} samples need {need} KV pages "
                               f"each; the decode pool has {spec.num_pages} (ask for fewer samples, or "
                               "serve with more num_pages)")
        prompt_pages = pages_needed(max(prompt_len - 1, 1), page_size)
        if prompt_pages > self.pool.max_reservable_pages():
            raise RequestError("input_ids", f"the prompt needs {prompt_pages} KV pages; a "
                               f"reservation can hold {self.pool.max_reservable_pages()} "
                               "(the pool less what running sequences keep)")

    def finalize(self) -> None:
        if getattr(self, "prefill", None) is not None:
            self.prefill.close()
        receiver, pool = getattr(self, "receiver", None), getattr(self, "pool", None)
        if receiver is not None:
            # a version roll: the transfers this instance started finish (or fail) first
            drained = receiver.drain(float(self.settings.kv_drain_s))
            if not drained:
                pb_utils.Logger.log_warn(f"[kv_transfer] transfers still in flight after "
                                         f"{self.settings.kv_drain_s}s of draining; they fail")
        poller = getattr(self, "metrics_poller", None)
        if poller is not None:
            poller.stop()
        if receiver is not None:
            receiver.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()   # while the stub can still talk to the server
            self.metrics = None
        board = getattr(self, "decode_board", None)
        if pool is not None:
            # the last process attached removes the files (another version may still use them)
            last = pool.close(unlink_if_last=True)
            if board is not None:
                board.close(unlink=last)
