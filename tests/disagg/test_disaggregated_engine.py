"""Prefill engine -> KV transfer -> decode engine, against the colocated engine.

The decoder samples the first token from the last prompt token (prefill never
samples), so greedy output must equal ``LLM.generate`` token for token; pages and
reservations must return to where they started.
"""
from __future__ import annotations

import threading

import pytest
import torch

from tandem.backends.disagg import SharedPoolTicket, context_nbytes, decode_engine, shard_scheme
from tandem.backends.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tandem.backends.engine.prefill_engine import PrefillEngine, PrefillHooks
from tandem.rdma import DestinationDescriptor, ShardScheme

from ..unit.kv_reference import token_kv

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Path:",
           "x = [i * i for i in range(10)]\nprint(", "    return self._data[key]\n\n    def ",
           "# " + "the quick brown fox jumps over the lazy dog " * 3]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def colocated(demo_checkpoint):
    llm = LLM(str(demo_checkpoint), page_size=4)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm.engine


class _Recorder(PrefillHooks):
    def __init__(self):
        self.forwards, self.layers = [], 0

    def before_forward(self, chunks):
        self.forwards.append([(r.request_id, end) for r, end in chunks])
        def layer_done(layer):
            self.layers += 1
        return layer_done


def test_prefill_engine_chunks_and_add_prefilled_continue_in_process(demo_checkpoint, colocated):
    """Part (a) and (b) without processes: prefill KV copied page by page into the
    decoder's pool, then the decoder continues from it."""
    expected, ref = colocated
    hooks = _Recorder()
    prefill = PrefillEngine.from_config(EngineConfig(str(demo_checkpoint), page_size=4,
                                                     max_num_batched_tokens=8, num_pages=64), hooks)
    decoder = LLMEngine(EngineConfig(str(demo_checkpoint), page_size=4))
    ids = [ref.tokenize(p) for p in PROMPTS]
    for i, toks in enumerate(ids):
        prefill.add(f"p{i}", toks[:-1])
    done = {}
    while prefill.has_work():
        for r in prefill.step():
            done[r.request_id] = r
    assert max(len(f) for f in hooks.forwards) > 1 and len(hooks.forwards) > 2   # batched, chunked
    assert hooks.layers == len(hooks.forwards) * prefill.model.config.num_hidden_layers
    outs = {}
    for i, toks in enumerate(ids):
        r = done[f"p{i}"]
        assert r.hidden.shape == (prefill.model.config.hidden_size,)
        pages = decoder.allocator.alloc(len(r.pages))
        decoder.pool.kv[:, pages] = prefill.pool.kv[:, r.pages]
        prefill.release(f"p{i}")
        seq = decoder.make_sequence(toks, GREEDY, request_id=f"d{i}")
        decoder.add_prefilled(seq, pages)
        outs[f"d{i}"] = seq
    assert prefill.allocator.num_free == prefill.allocator.num_pages
    while decoder.has_unfinished():
        decoder.step()
    assert [outs[f"d{i}"].output_ids for i in range(len(ids))] == expected
    assert decoder.allocator.num_free == decoder.allocator.num_pages


def _decode_remote_prefills(engine, pool, ids, rx_peer, prefill_peer, model_dir, src=ShardScheme(1)):
    """Reserve (for a prefill split as ``src``), submit every request to the decoder
    first (it waits for each KV without blocking), have the prefill peer run them all;
    returns (tokens, finish reasons)."""
    ctx = context_nbytes(model_dir, "float32")
    descs = [rx_peer("rx_reserve", len(t) - 1, src=(src.tp_size, src.replica_sets), context_nbytes=(ctx,))
             for t in ids]
    assert pool.stats().reserved > 0
    tokens = {i: [] for i in range(len(ids))}
    reasons, finished = {}, threading.Semaphore(0)

    def collect(i):
        def on_output(out):
            tokens[i].extend(out.new_token_ids)
            if out.finished:
                reasons[i] = out.finish_reason
                finished.release()
        return on_output
    for i, (t, d) in enumerate(zip(ids, descs)):
        d = DestinationDescriptor.from_bytes(d)
        engine.submit_prefilled(t, GREEDY, SharedPoolTicket(pool, d.slot, d.generation), collect(i))
    assert prefill_peer("prefill_run", list(zip(descs, ids))) == ["ok"] * len(ids)
    for _ in ids:
        assert finished.acquire(timeout=60)
    return [tokens[i] for i in range(len(ids))], [reasons[i] for i in range(len(ids))]


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_disaggregated_greedy_equals_colocated(demo_checkpoint, colocated, make_decode_pool,
                                               rx_peer, prefill_peer, kv_layout):
    expected, ref = colocated
    model_dir = str(demo_checkpoint)
    pool = make_decode_pool(model_dir, page_size=4, kv_layout=kv_layout, num_pages=64)
    start = pool.stats()
    rx_peer("rx_start", pool.spec.name)
    prefill_peer("prefill_start", model_dir, page_size=4, kv_layout=kv_layout,
                 max_num_batched_tokens=8, num_pages=32)
    prefill_start_pages = prefill_peer("prefill_pages")
    engine = decode_engine(pool, model_dir, dtype="float32", max_num_batched_tokens=64)
    engine.start()
    try:
        ids = [ref.tokenize(p) for p in PROMPTS]
        tokens, reasons = _decode_remote_prefills(engine, pool, ids, rx_peer, prefill_peer,
                                                  model_dir)
        assert reasons == ["length"] * len(ids)
        assert tokens == expected
    finally:
        engine.shutdown()
    assert pool.stats() == start
    assert prefill_peer("prefill_pages") == prefill_start_pages


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (1, 4), (2, 1), (2, 2), (4, 1)])
def test_prefill_and_decode_split_over_different_ranks(demo_checkpoint, colocated, make_decode_pool, rx_peer,
                                                       prefill_peer, prefill_tp, decode_tp):
    """The demo's 2 KV heads over prefill and decode ranks: TP 1 -> 2 (each page split by
    head range into the decode ranks' files), 1 -> 4 (heads replicated over decode's two
    replica sets), 2 -> 1 (each page rebuilt from the two prefill ranks' halves, every
    prefill rank sending from its shared-memory pool), 2 -> 2 (rank to rank), 4 -> 1
    (one replica set of the prefill's sends, the other's pages stay home). Every write
    is counted: the decoder's ranks continue from it and the greedy text is the colocated
    engine's, twice; the receiver got exactly the bytes the plans say; every page and
    reservation comes back."""
    expected, ref = colocated
    model_dir = str(demo_checkpoint)
    pool = make_decode_pool(model_dir, page_size=4, num_pages=64, tp=decode_tp)
    assert pool.spec.scheme.tp_size == decode_tp
    start = pool.stats()
    rx_peer("rx_start", pool.spec.name)
    prefill_peer("prefill_start", model_dir, page_size=4, max_num_batched_tokens=8, num_pages=32,
                 tensor_parallel_size=prefill_tp)
    prefill_start_pages = prefill_peer("prefill_pages")
    engine = decode_engine(pool, model_dir, dtype="float32", max_num_batched_tokens=64,
                           tensor_parallel_size=decode_tp)
    engine.start()
    cfg = engine.engine.model.config
    src = shard_scheme(cfg.num_key_value_heads, prefill_tp)
    try:
        assert engine.engine.pool.num_kv_heads == max(cfg.num_key_value_heads // decode_tp, 1)
        ids = [ref.tokenize(p) for p in PROMPTS]
        for _ in range(2):
            received = rx_peer("rx_stats")["bytes_received"]
            tokens, reasons = _decode_remote_prefills(engine, pool, ids, rx_peer, prefill_peer, model_dir, src)
            assert reasons == ["length"] * len(ids)
            assert tokens == expected
            # exactly the bytes the plans say: every rank's head range of every page, and the context
            assert rx_peer("rx_stats")["bytes_received"] - received == sum(
                planned_bytes(pool, src, len(t) - 1, context_nbytes(model_dir, "float32")) for t in ids)
    finally:
        engine.shutdown()
    assert pool.stats() == start
    assert prefill_peer("prefill_pages") == prefill_start_pages


def planned_bytes(pool, src, num_tokens: int, context: int) -> int:
    """The bytes a prefill split as ``src`` sends for ``num_tokens`` tokens into ``pool``."""
    from tandem.rdma.plan import pages_needed, plan_transfer
    page_size = pool.spec.models[0].page_size
    plan = plan_transfer(pool.spec.models, list(range(pages_needed(num_tokens, page_size))), num_tokens,
                         src, pool.spec.scheme, context_nbytes=(context,))
    return sum(m.num_layers * int(ops.nbytes.sum()) for m, ops in zip(plan.models, plan.layer_ops)) + context


def test_a_descriptor_for_another_prefill_split_is_refused_by_name(demo_checkpoint, make_decode_pool, rx_peer,
                                                                   prefill_peer):
    """A decode server planning for one prefill rank, fed by a prefill of two: the job is
    refused before anything is prefilled, naming the setting to change."""
    model_dir = str(demo_checkpoint)
    pool = make_decode_pool(model_dir, page_size=4, num_pages=16)
    rx_peer("rx_start", pool.spec.name)
    prefill_peer("prefill_start", model_dir, page_size=4, num_pages=16, tensor_parallel_size=2)
    desc = rx_peer("rx_reserve", 5, context_nbytes=(context_nbytes(model_dir, "float32"),))
    error = prefill_peer("prefill_submit", desc, list(range(1, 7)))
    assert "planned this transfer for a prefill of 1 tensor-parallel rank(s); this prefill runs 2" in error
    assert "--prefill-tp 2" in error


def test_a_decode_engine_split_differently_from_its_pool_is_refused(demo_checkpoint, make_decode_pool):
    pool = make_decode_pool(str(demo_checkpoint), page_size=4, num_pages=16, tp=2)
    with pytest.raises(ValueError, match="split for 2 decode rank"):
        decode_engine(pool, str(demo_checkpoint), dtype="float32")


def test_fragmented_pools_and_mixed_lengths_keep_every_page_in_place(
        demo_checkpoint, colocated, make_decode_pool, rx_peer, prefill_peer):
    """After churn neither side's free pages are in id order: prompts of mixed lengths
    prefilled together still land page for page where the decoder reads them."""
    import random
    expected, ref = colocated
    model_dir = str(demo_checkpoint)
    pool = make_decode_pool(model_dir, page_size=4, num_pages=64)
    held = pool.alloc(48)
    random.Random(1).shuffle(held)
    pool.free(held)
    start = pool.stats()
    rx_peer("rx_start", pool.spec.name)
    prefill_peer("prefill_start", model_dir, page_size=4, max_num_batched_tokens=16, num_pages=48)
    prefill_peer("prefill_fragment", 2)
    engine = decode_engine(pool, model_dir, dtype="float32", max_num_batched_tokens=64)
    engine.start()
    try:
        ids = [ref.tokenize(p) for p in PROMPTS]
        for _ in range(2):     # the second round runs on pages the first one freed
            tokens, _ = _decode_remote_prefills(engine, pool, ids, rx_peer, prefill_peer,
                                                model_dir)
            assert tokens == expected
    finally:
        engine.shutdown()
    assert pool.stats() == start


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_transfer_ends_or_recomputes_the_request_and_frees_everything(demo_checkpoint, make_decode_pool,
                                                                             rx_peer, policy):
    """No prefill ever comes: the reservation times out; the decoder ends the request
    with an error (``fail``) or prefills it itself (``recompute``), and nothing leaks; a
    request running beside it is not stalled."""
    model_dir = str(demo_checkpoint)
    pool = make_decode_pool(model_dir)
    start = pool.stats()
    rx_peer("rx_start", pool.spec.name, fail_grace_s=30.0, timeout_s=1.0)
    engine = decode_engine(pool, model_dir, dtype="float32", kv_load_failure_policy=policy)
    engine.start()
    try:
        d = DestinationDescriptor.from_bytes(rx_peer("rx_reserve", 7, context_nbytes=(
            context_nbytes(model_dir, "float32"),)))
        ended = {}
        events = {k: threading.Event() for k in ("remote", "local")}

        errors = {}

        def on(key):
            def cb(out):
                if out.finished:
                    ended[key], errors[key] = out.finish_reason, out.error
                    events[key].set()
            return cb
        engine.submit_prefilled(list(range(3, 11)), GREEDY,
                                SharedPoolTicket(pool, d.slot, d.generation), on("remote"))
        engine.submit("def main():", GREEDY, on("local"))
        assert events["local"].wait(30) and ended["local"] == "length"
        assert not events["remote"].is_set()          # still waiting for its KV
        assert events["remote"].wait(30)
        if policy == "fail":
            assert ended["remote"] == "error"
            assert "no KV arrived within the transfer timeout" in errors["remote"]
        else:
            assert ended["remote"] == "length" and errors["remote"] is None
        assert engine.transfer_failures == {"timeout": 1}
        assert engine.transfer_recomputes == (policy == "recompute")
    finally:
        engine.shutdown()
    assert pool.stats().free == start.free and pool.stats().slots_active == 0


def test_a_prefill_that_fails_gives_the_reservation_up_and_decode_recomputes(demo_checkpoint, colocated,
                                                                             make_decode_pool, rx_peer,
                                                                             prefill_peer):
    """The prefill cannot take a job (a prompt larger than its pool): it gives the
    reservation up, so the decoder learns at once (reason ``prefill_failed``, not the
    lease's ``timeout``: the lease here outlasts the test) and recomputes the request;
    the greedy text is the colocated engine's and nothing leaks."""
    expected, ref = colocated
    model_dir = str(demo_checkpoint)
    pool = make_decode_pool(model_dir, page_size=4, num_pages=64)
    start = pool.stats()
    rx_peer("rx_start", pool.spec.name, timeout_s=600.0)
    prefill_peer("prefill_start", model_dir, page_size=4, num_pages=4)    # 16 tokens at most
    engine = decode_engine(pool, model_dir, dtype="float32", max_num_batched_tokens=64)
    engine.start()
    try:
        ids = ref.tokenize(PROMPTS[4])
        assert len(ids) > 17
        desc = rx_peer("rx_reserve", len(ids) - 1, context_nbytes=(context_nbytes(model_dir, "float32"),))
        d = DestinationDescriptor.from_bytes(desc)
        tokens, done = [], threading.Event()

        def on_output(out):
            tokens.extend(out.new_token_ids)
            if out.finished:
                done.set()
        engine.submit_prefilled(ids, GREEDY, SharedPoolTicket(pool, d.slot, d.generation), on_output)
        [error] = prefill_peer("prefill_run", [(desc, ids)])
        assert "KV pages" in error
        assert done.wait(300)
        assert tokens == expected[4]
        assert engine.transfer_failures == {"prefill_failed": 1} and engine.transfer_recomputes == 1
    finally:
        engine.shutdown()
    assert pool.stats().free == start.free and pool.stats().slots_active == 0


def _speculative(method, demo_checkpoint, random_mtp_head):
    from tandem.backends.speculative import SpeculativeConfig
    if method == "draft_target":   # self-speculation: any wrong draft KV shows as rejections
        return SpeculativeConfig("draft_target", 3, draft_model=str(demo_checkpoint))
    if method == "ngram":          # no proposer KV: the reservation holds the target's only
        return SpeculativeConfig("ngram", 3, prompt_lookup_min=1)
    return SpeculativeConfig("mtp", 3, mtp_head=str(random_mtp_head))


@pytest.mark.parametrize("method,prefill_tp,decode_tp", [
    ("draft_target", 1, 1), ("mtp", 1, 1), ("ngram", 1, 1),
    ("draft_target", 2, 2), ("mtp", 2, 2), ("draft_target", 2, 1), ("mtp", 1, 2)])
def test_disaggregated_speculation_equals_colocated(demo_checkpoint, colocated, random_mtp_head,
                                                   make_decode_pool, rx_peer, prefill_peer,
                                                   method, prefill_tp, decode_tp):
    """The prefill fills the proposer's KV too and it travels in the same reservation:
    the decoder speculates from its first step and its greedy output equals plain
    decoding (self-speculation accepting every draft shows the draft KV arrived intact).
    With tensor-parallel ranks on either side the proposer runs on rank 0 alone, so its
    KV goes whole from prefill's rank 0 to decode's, beside the target's split KV."""
    expected, ref = colocated
    model_dir, spec = str(demo_checkpoint), _speculative(method, demo_checkpoint, random_mtp_head)
    co = LLM(model_dir, page_size=4, speculative=spec)
    assert [o.token_ids for o in co.generate(PROMPTS, GREEDY)] == expected
    co_metrics = co.engine.spec_metrics
    del co

    pool = make_decode_pool(model_dir, page_size=4, num_pages=64, speculative=spec, tp=decode_tp)
    assert [m.name for m in pool.spec.models] == ["target"] + ([spec.kv_name] if spec.has_kv else [])
    start = pool.stats()
    rx_peer("rx_start", pool.spec.name)
    prefill_peer("prefill_start", model_dir, page_size=4, max_num_batched_tokens=8,
                 num_pages=32, speculative=spec, tensor_parallel_size=prefill_tp)
    engine = decode_engine(pool, model_dir, dtype="float32", max_num_batched_tokens=64,
                           speculative=spec, tensor_parallel_size=decode_tp)
    engine.start()
    try:
        ids = [ref.tokenize(p) for p in PROMPTS]
        src = shard_scheme(engine.engine.model.config.num_key_value_heads, prefill_tp)
        tokens, _ = _decode_remote_prefills(engine, pool, ids, rx_peer, prefill_peer, model_dir, src)
        assert tokens == expected
        m = engine.spec_metrics
        # ngram speculates only in steps where every sequence has a match, which depends
        # on how the requests' arrivals overlap: its drafting is shown in tests/unit
        assert m.num_drafts > 0 or method == "ngram"
        if method == "draft_target":
            assert m.acceptance_rate == 1.0 == co_metrics.acceptance_rate
    finally:
        engine.shutdown()
    assert pool.stats() == start


def test_prefill_refuses_a_reservation_without_the_proposers_kv(demo_checkpoint, random_mtp_head):
    """Both sides must speculate alike: a plain reservation cannot feed an MTP prefill."""
    from tandem.backends.disagg import PrefillService, decode_pool_spec
    from tandem.rdma.descriptor import DestinationDescriptor as Desc
    spec = _speculative("mtp", demo_checkpoint, random_mtp_head)
    svc = PrefillService(EngineConfig(str(demo_checkpoint), page_size=4, num_pages=8,
                                      speculative=spec))
    try:
        plain = decode_pool_spec("unused", str(demo_checkpoint), "float32", 4, "HND", 8)
        desc = Desc(b"addr", 0, 1, 3, (0,), plain.models, plain.scheme, plain.scheme, 1, (), 0)
        with pytest.raises(ValueError, match="do both sides speculate alike"):
            svc.submit(desc, [1, 2, 3, 4], lambda e: None)
    finally:
        svc.shutdown()


@pytest.mark.parametrize("method", ["draft_target", "mtp"])
def test_prefill_fills_the_proposers_kv_as_a_colocated_engine_does(
        demo_checkpoint, random_mtp_head, colocated, method):
    """The proposer's KV that the prefill computes chunk by chunk (the MTP head reading
    the tokens one ahead) equals what the colocated engine's proposer caches."""
    _, ref = colocated
    model_dir, spec = str(demo_checkpoint), _speculative(method, demo_checkpoint, random_mtp_head)
    prefill = PrefillEngine.from_config(EngineConfig(model_dir, page_size=4, num_pages=32,
                                                     max_num_batched_tokens=5, speculative=spec))
    co = LLMEngine(EngineConfig(model_dir, page_size=4, speculative=spec))
    ids = ref.tokenize(PROMPTS[1])
    prefill.add("p", ids[:-1], last_token=ids[-1])
    while prefill.has_work():
        prefill.step()
    co.add_request(ids, GREEDY, request_id="c")
    co.step()                         # prefill, then the proposer catches up past the prompt
    seq, n = co.seqs["c"], len(ids) - 1
    assert seq.draft.computed >= n
    got = token_kv(prefill.proposer.pool, prefill.finished["p"].pages, n)
    want = token_kv(co.proposer.runner.pool, seq.pages, n)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    prefill.release("p")


# -- prefix caching across prefill and decode ---------------------------------------------------
TURN = "\n\nclass Stack:\n    def push(self, item):\n        self.items.append(item)\n"


def _cached_remote_prefills(engine, pool, ids, rx_peer, prefill_peer, model_dir, lookahead):
    """As :func:`_decode_remote_prefills`, each reservation sharing what decode's cache
    holds of its prompt (kv_transfer's lookup); returns (tokens, pages shared per prompt)."""
    from tandem.backends.engine.prefix_caching import prompt_page_keys
    ctx = context_nbytes(model_dir, "float32")
    root = pool.cache_root()
    descs = [rx_peer("rx_reserve", len(t) - 1, context_nbytes=(ctx,),
                     cached_keys=prompt_page_keys(t, 4, root, None, lookahead)) for t in ids]
    streams = Streams(len(ids))
    for i, (t, d) in enumerate(zip(ids, descs)):
        ticket = SharedPoolTicket.for_descriptor(pool, d, len(t), engine.allocator)
        engine.submit_prefilled(t, GREEDY, ticket, streams.on_output(i))
    assert prefill_peer("prefill_run", list(zip(descs, ids))) == ["ok"] * len(ids)
    shared = [DestinationDescriptor.from_bytes(d).first_page for d in descs]
    return streams.wait(60), shared


class Streams:
    """The tokens of n requests' output callbacks; :meth:`wait` for all to finish."""

    def __init__(self, n: int):
        self.tokens = [[] for _ in range(n)]
        self._finished = threading.Semaphore(0)

    def on_output(self, i: int):
        def on_output(out):
            self.tokens[i].extend(out.new_token_ids)
            if out.finished:
                self._finished.release()
        return on_output

    def wait(self, timeout_s: float) -> list[list[int]]:
        for _ in self.tokens:
            assert self._finished.acquire(timeout=timeout_s)
        return self.tokens


@pytest.mark.parametrize("method, kv_layout", [(None, "HND"), (None, "NHD"), ("draft_target", "HND"),
                                               ("mtp", "NHD"), ("ngram", "HND")])
def test_prefix_caching_across_prefill_and_decode_keeps_greedy_output(
        demo_checkpoint, random_mtp_head, make_decode_pool, rx_peer, prefill_peer, method, kv_layout):
    """Decode's cache in the shared pool, the prefill server's own: cold prompts, a new
    turn on each (the prefix shared from decode's cache, only the rest sent), and the
    turns again (every full page but the last shared): greedy output equals a colocated
    engine with caching off, round after round, and every page comes back."""
    from tandem.backends.engine.prefix_caching import key_lookahead
    model_dir = str(demo_checkpoint)
    spec = _speculative(method, demo_checkpoint, random_mtp_head) if method else None
    plain = LLM(model_dir, page_size=4, speculative=spec, enable_prefix_caching=False)
    turns = [p + TURN for p in PROMPTS]
    expected = {"cold": [o.token_ids for o in plain.generate(PROMPTS, GREEDY)],
                "turn": [o.token_ids for o in plain.generate(turns, GREEDY)]}
    ref = plain.engine
    del plain

    pool = make_decode_pool(model_dir, page_size=4, kv_layout=kv_layout, num_pages=96,
                            speculative=spec, prefix_caching=True)
    start = pool.stats()
    rx_peer("rx_start", pool.spec.name)
    prefill_peer("prefill_start", model_dir, page_size=4, kv_layout=kv_layout,
                 max_num_batched_tokens=16, num_pages=64, speculative=spec)
    engine = decode_engine(pool, model_dir, dtype="float32", max_num_batched_tokens=64,
                           speculative=spec)
    engine.start()
    try:
        la = key_lookahead(spec)
        run = lambda prompts: _cached_remote_prefills(   # noqa: E731
            engine, pool, [ref.tokenize(p) for p in prompts], rx_peer, prefill_peer, model_dir, la)
        tokens, shared = run(PROMPTS)
        assert tokens == expected["cold"] and shared == [0] * len(PROMPTS)
        tokens, shared = run(turns)
        assert tokens == expected["turn"] and all(s > 0 for s in shared)
        again, shared_again = run(turns)
        assert again == expected["turn"]
        # every full page short of the last token, but one page always travels
        n = [len(ref.tokenize(t)) for t in turns]
        assert shared_again == [min((k - 1) // 4, -(-(k - 1) // 4) - 1) for k in n]
        assert engine.prefix_cache.hit_tokens >= 4 * (sum(shared) + sum(shared_again))
    finally:
        engine.shutdown()
    end = pool.stats()
    assert (end.free, end.reserved, end.in_use, end.slots_active) == (start.free, 0, 0, 0)
    assert end.cached > 0


def test_eviction_under_pressure_in_the_shared_pool_keeps_greedy_output(demo_checkpoint,
                                                                        make_decode_pool):
    """Decode prefilling for itself on a small shared pool with its cache: prompts that
    share prefixes, run four at a time, evict each other's cached pages; every greedy
    output equals a colocated engine's with caching off, and every page comes back."""
    model_dir = str(demo_checkpoint)
    prompts = [PROMPTS[i % len(PROMPTS)] + TURN * (i % 3) for i in range(12)]
    plain = LLM(model_dir, page_size=4, enable_prefix_caching=False)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    del plain
    pool = make_decode_pool(model_dir, page_size=4, num_pages=48, prefix_caching=True)
    engine = decode_engine(pool, model_dir, dtype="float32", max_num_seqs=4,
                           max_num_batched_tokens=32)
    engine.start()
    try:
        for rnd in range(2):
            streams = Streams(len(prompts))
            for i, p in enumerate(prompts):
                engine.submit(p, GREEDY, streams.on_output(i))
            assert streams.wait(120) == expected, f"round {rnd}"
        stats = engine.prefix_cache
        assert stats.hit_tokens > 0 and stats.evictions > 0
    finally:
        engine.shutdown()
    end = pool.stats()
    assert (end.free, end.reserved, end.in_use) == (48, 0, 0)


@pytest.fixture(scope="module", params=("llama_gqa_untied", "llama3_rope_tied", "qwen2", "qwen3"))
def family(request, tmp_path_factory):
    from ..unit.tiny_checkpoints import make_checkpoint
    return str(make_checkpoint(request.param, tmp_path_factory.mktemp("families")))


def test_prefix_caching_across_prefill_and_decode_for_each_family(family, make_decode_pool,
                                                                  rx_peer, prefill_peer):
    """Every architecture (GQA untied, Llama-3 RoPE tied, Qwen2's biases, Qwen3's QK
    norms): a conversation and its next turn through a prefill server into decode's
    cache give the greedy tokens of a colocated engine with caching off."""
    g = torch.Generator().manual_seed(5)
    convs = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (23, 30)]
    turns = [c + torch.randint(3, 380, (9,), generator=g).tolist() for c in convs]
    plain = LLM(family, dtype="float32", page_size=4, enable_prefix_caching=False)
    expected = [o.token_ids for o in plain.generate(convs + turns, GREEDY)]
    del plain
    pool = make_decode_pool(family, page_size=4, num_pages=64, prefix_caching=True)
    rx_peer("rx_start", pool.spec.name)
    prefill_peer("prefill_start", family, page_size=4, max_num_batched_tokens=16, num_pages=48)
    engine = decode_engine(pool, family, dtype="float32", max_num_batched_tokens=64)
    engine.start()
    try:
        tokens, shared = _cached_remote_prefills(engine, pool, convs, rx_peer, prefill_peer, family, 0)
        assert tokens == expected[:2] and shared == [0, 0]
        tokens, shared = _cached_remote_prefills(engine, pool, turns, rx_peer, prefill_peer, family, 0)
        assert tokens == expected[2:] and all(s >= 5 for s in shared)
    finally:
        engine.shutdown()
