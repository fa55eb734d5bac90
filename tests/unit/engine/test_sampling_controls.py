"""Per-request sampling controls: repetition, presence and frequency
penalties, min_tokens, bad_words, logit_bias and logprobs, each checked against a
reference computed here from the model's fp32 logits (HF transformers, step by step,
the control applied by hand), in plain decoding and with speculation (draft-target and
MTP), next to plain requests that must not notice them."""
from __future__ import annotations

import functools
import math
from collections import Counter

import pytest
import torch

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.engine.logits_processors import LogitsControls, apply_controls
from tandem.backends.engine.sampler import verify_drafts
from tandem.backends.models import load_model
from tandem.backends.models.mtp import MTPHead, save_mtp_head

from ..tiny_checkpoints import make_checkpoint, make_checkpoint_with_tokenizer

NEW_TOKENS = 20
EOS = 2                       # the tiny checkpoints' eos_token_id
SPECS = [None, "draft_target", "draft_target_self", "mtp"]


@pytest.fixture(scope="module")
def target_dir(checkpoint_root):
    """llama_gqa_untied with a tokenizer (for bad_words and stop strings)."""
    return make_checkpoint_with_tokenizer(checkpoint_root)


@pytest.fixture(scope="module")
def make_llm(target_dir, checkpoint_root):
    other = make_checkpoint("llama3_rope_tied", checkpoint_root)
    mtp = checkpoint_root / "controls_mtp"
    if not mtp.exists():
        torch.manual_seed(3)
        save_mtp_head(MTPHead(load_model(target_dir).config), mtp, torch.float32)
    specs = {None: None,
             "draft_target": SpeculativeConfig("draft_target", 3, draft_model=str(other)),
             # the target drafting for itself: most drafts accepted, so every verified
             # position matters
             "draft_target_self": SpeculativeConfig("draft_target", 3, draft_model=str(target_dir)),
             "mtp": SpeculativeConfig("mtp", 3, mtp_head=str(mtp))}

    def make(spec, **kw):
        return LLM(target_dir, speculative=specs[spec], **kw)
    return make


def prompts(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (m,), generator=g).tolist() for m in (5, 12, 20, 9, 15)[:n]]


# -- the reference: the model's fp32 logits, the control applied by hand ------------------

@functools.lru_cache(maxsize=None)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    return hf_model(str(model_dir))(torch.tensor([ids])).logits[0, -1].float()


def reference_greedy(model_dir, prompt, process=lambda logits, out: logits, stop_ids=(EOS,),
                     max_tokens=NEW_TOKENS):
    """Greedy decoding by hand: (tokens, log-softmax of the processed logits of each)."""
    out, logprobs = [], []
    for _ in range(max_tokens):
        logits = process(hf_logits(model_dir, prompt + out).clone(), out)
        token = int(logits.argmax())
        out.append(token)
        logprobs.append(float(logits.log_softmax(-1)[token]))
        if token in stop_ids:
            break
    return out, logprobs


def repetition(penalty, prompt):
    def process(logits, out):
        for t in set(prompt) | set(out):
            logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
        return logits
    return process


def presence_frequency(presence, frequency):
    def process(logits, out):
        for t, count in Counter(out).items():
            logits[t] -= frequency * count + presence
        return logits
    return process


def min_tokens(n, stop_ids):
    def process(logits, out):
        if len(out) < n:
            logits[list(stop_ids)] = -math.inf
        return logits
    return process


def banned_words(words: list[tuple[int, ...]]):
    def process(logits, out):
        for w in words:
            prefix = w[:-1]
            if len(out) >= len(prefix) and tuple(out[len(out) - len(prefix):]) == prefix:
                logits[w[-1]] = -math.inf
        return logits
    return process


def bias(table):
    def process(logits, out):
        for t, b in table.items():
            logits[t] += b
        return logits
    return process


def chain(*processes):
    """vLLM's order: bad words, min_tokens, logit_bias, then the penalties."""
    def process(logits, out):
        for p in processes:
            logits = p(logits, out)
        return logits
    return process


def hand_process(logits, out, prompt, params, bans, stop_ids):
    """Every control of ``params`` by hand, in vLLM's order."""
    return chain(banned_words(bans), min_tokens(params.min_tokens, stop_ids),
                 bias(params.logit_bias), repetition(params.repetition_penalty, prompt),
                 presence_frequency(params.presence_penalty, params.frequency_penalty)
                 )(logits.clone(), out)


def filtered_logprobs(logits, temperature, top_k, top_p):
    """log of temperature/top-k/top-p filtered probabilities, written out by hand
    (top-p over the top-k renormalized, as vLLM)."""
    scaled = logits / temperature
    order = scaled.argsort(descending=True).tolist()[:top_k or None]
    probs = scaled[order].softmax(-1).tolist()
    keep, mass = [], 0.0
    for t, prob in zip(order, probs):
        if keep and mass >= top_p:
            break
        keep.append(t)
        mass += prob
    mask = torch.ones_like(scaled, dtype=torch.bool)
    mask[keep] = False
    return scaled.masked_fill(mask, -math.inf).log_softmax(-1)


def vllm_bad_word_ids(tokenizer, word):
    """vLLM's rule, written out: the word as is, and with a leading space when that is
    a different first token and as many tokens."""
    enc = lambda s: tuple(tokenizer.encode(s, add_special_tokens=False).ids)
    plain, spaced = enc(word.lstrip()), enc(" " + word.lstrip())
    return [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])


# -- each control, plain and speculative ----------------------------------------------------

def greedy(**kw):
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, **kw)


def check_against_reference(llm, target_dir, params_per_prompt, processes,
                            stop_ids_per_prompt=None):
    ps = prompts(len(params_per_prompt))
    outs = llm.generate(ps, params_per_prompt)
    changed = False
    for i, (p, o) in enumerate(zip(ps, outs)):
        stop_ids = stop_ids_per_prompt[i] if stop_ids_per_prompt else (EOS,)
        ref, _ = reference_greedy(target_dir, p, processes[i], stop_ids,
                                  params_per_prompt[i].max_tokens)
        assert o.token_ids == ref, f"prompt {i}"
        changed |= ref != reference_greedy(target_dir, p, stop_ids=(), max_tokens=len(ref))[0]
    assert changed, "the control changed no output: the test would not see it ignored"
    a = llm.engine.allocator
    assert a.num_free == a.num_pages and not llm.engine.has_unfinished()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("control", ["repetition", "presence_frequency", "all_penalties",
                                     "logit_bias"])
def test_penalties_and_bias_match_the_reference(target_dir, make_llm, spec, control):
    ps = prompts()
    table = {17: 1.0, 250: 0.5, 183: -100.0, 288: -3.0}
    kw, procs = {
        "repetition": (dict(repetition_penalty=1.6), [repetition(1.6, p) for p in ps]),
        "presence_frequency": (dict(presence_penalty=1.5, frequency_penalty=0.8),
                               [presence_frequency(1.5, 0.8)] * 3),
        "all_penalties": (dict(repetition_penalty=1.3, presence_penalty=-0.5,
                               frequency_penalty=1.2),
                          [chain(repetition(1.3, p), presence_frequency(-0.5, 1.2)) for p in ps]),
        "logit_bias": (dict(logit_bias=table, repetition_penalty=0.8),
                       [chain(bias(table), repetition(0.8, p)) for p in ps]),
    }[control]
    llm = make_llm(spec)
    check_against_reference(llm, target_dir, [greedy(**kw)] * 3, procs)
    if spec == "draft_target_self":
        assert llm.engine.spec_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("spec", SPECS)
def test_min_tokens_masks_stop_ids_until_reached(target_dir, make_llm, spec):
    """Each prompt's stop id is its greedy second token: without min_tokens it stops at
    once; with it, the stop ids (and EOS) are masked for the first 6 tokens."""
    ps = prompts()
    plain = [reference_greedy(target_dir, p, stop_ids=())[0] for p in ps]
    stops = [(EOS, g[1]) for g in plain]
    params = [greedy(stop_token_ids=[g[1]], min_tokens=6) for g in plain]
    unmasked = make_llm(spec).generate(ps, [greedy(stop_token_ids=[g[1]]) for g in plain])
    assert all(len(o.token_ids) <= 2 and o.finish_reason == "stop" for o in unmasked)
    llm = make_llm(spec)
    check_against_reference(llm, target_dir, params, [min_tokens(6, s) for s in stops], stops)
    outs = llm.generate(ps, params)
    for o, (_, stop) in zip(outs, stops):
        assert len(o.token_ids) > 6
        assert stop not in o.token_ids[:6] and EOS not in o.token_ids[:6]


def test_min_tokens_holds_back_stop_strings(target_dir, make_llm):
    llm = make_llm(None)
    tok = llm.tokenizer
    p = prompts(1)[0]
    plain = llm.generate(p, greedy(ignore_eos=True))[0]
    # a stop string the plain output completes at its first token
    stop = tok.decode(plain.token_ids[:1]).strip()
    assert stop and "\ufffd" not in stop
    early = llm.generate(p, greedy(ignore_eos=True, stop=[stop]))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == 1
    held = llm.generate(p, greedy(ignore_eos=True, stop=[stop], min_tokens=5))[0]
    assert len(held.token_ids) > 5
    assert held.token_ids == plain.token_ids[:len(held.token_ids)]   # the logits never changed
    if held.finish_reason == "stop":                                 # a later occurrence ended it
        assert stop not in held.text


def single_and_multi_token_words(tok, tokens):
    """From a greedy output: a word that is one token, and two output tokens in a row
    that tokenize back to themselves (a two-token word)."""
    clean = lambda s: s.strip() and "\ufffd" not in s and s.isprintable()
    single = next(tok.decode([t]) for t in tokens if clean(tok.decode([t]))
                  and len(vllm_bad_word_ids(tok, tok.decode([t]))[0]) == 1)
    multi = next(tok.decode(list(pair)) for pair in zip(tokens, tokens[1:])
                 if clean(tok.decode(list(pair)))
                 and vllm_bad_word_ids(tok, tok.decode(list(pair)))[0] == pair)
    return single, multi


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("kind", ["single", "multi"])
def test_bad_words_match_the_reference(target_dir, make_llm, spec, kind):
    llm = make_llm(spec)
    tok = llm.tokenizer
    ps = prompts()
    words = []
    for p in ps:
        plain = reference_greedy(target_dir, p, stop_ids=(), max_tokens=NEW_TOKENS)[0]
        try:
            words.append(single_and_multi_token_words(tok, plain)[kind == "multi"])
        except StopIteration:
            words.append(None)
    found = [i for i, w in enumerate(words) if w is not None]
    assert found, "no prompt gave a word to ban"
    ids = {i: vllm_bad_word_ids(tok, words[i]) for i in found}
    if kind == "multi":
        assert all(len(w) == 2 for i in found for w in ids[i][:1])
    params = [greedy(bad_words=[words[i]]) for i in found]
    outs = llm.generate([ps[i] for i in found], params)
    changed = False
    for i, o in zip(found, outs):
        ref, _ = reference_greedy(target_dir, ps[i], banned_words(ids[i]))
        assert o.token_ids == ref, f"prompt {i}, bad word {words[i]!r}"
        plain = reference_greedy(target_dir, ps[i], max_tokens=len(ref))[0]
        changed |= ref != plain
        for w in ids[i]:   # the banned sequence never appears
            assert not any(tuple(ref[j:j + len(w)]) == w for j in range(len(ref)))
    assert changed


@pytest.mark.parametrize("spec", SPECS)
def test_all_controls_together_in_chunked_prefill_and_under_preemption(target_dir, make_llm, spec):
    """Long prompts in chunks of 8, and a pool of room for two sequences: the controls'
    state survives chunking and recompute."""
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 384, (30,), generator=g).tolist() for _ in range(5)]
    table = {40: 3.0, 41: -2.0}
    params = greedy(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.6,
                    min_tokens=4, logit_bias=table, bad_words=["okenizer"], logprobs=True)
    tok = make_llm(None).tokenizer
    words = vllm_bad_word_ids(tok, "okenizer")
    llm = make_llm(spec, page_size=4, num_pages=2 * 13 + 4, max_num_batched_tokens=8)
    seqs = [llm.engine.make_sequence(p, params) for p in ps]
    for s in seqs:
        llm.engine.add(s)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    for p, s in zip(ps, seqs):
        ref, lps = reference_greedy(target_dir, p, chain(
            banned_words(words), min_tokens(4, (EOS,)), bias(table), repetition(1.4, p),
            presence_frequency(0.3, 0.6)))
        assert s.output_ids == ref
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(lps), atol=1e-4, rtol=0)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


# -- logprobs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("with_controls", [False, True])
def test_greedy_logprobs_match_the_reference(target_dir, make_llm, spec, with_controls):
    ps = prompts()
    kw = dict(repetition_penalty=1.5, frequency_penalty=0.5) if with_controls else {}
    llm = make_llm(spec)
    outs = llm.generate(ps, greedy(logprobs=True, **kw))
    for p, o in zip(ps, outs):
        process = chain(repetition(1.5, p), presence_frequency(0, 0.5)) if with_controls \
            else (lambda logits, out: logits)
        ref, lps = reference_greedy(target_dir, p, process)
        assert o.token_ids == ref
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(lps), atol=1e-4, rtol=0)
        assert o.cumulative_logprob == pytest.approx(sum(o.logprobs), abs=1e-5)


@pytest.mark.parametrize("spec", SPECS)
def test_sampled_logprobs_are_those_of_the_filtered_distribution(target_dir, make_llm, spec):
    """Whatever tokens were drawn, each logprob is log p(token) under the processed,
    temperature/top-k/top-p filtered distribution at its position."""
    ps = prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, top_k=40, top_p=0.9, seed=4,
                            repetition_penalty=1.3, presence_penalty=0.5, logprobs=True)
    for p, o in zip(ps, make_llm(spec).generate(ps, params)):
        assert len(o.logprobs) == len(o.token_ids) > 0
        for n, (token, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            out = o.token_ids[:n]
            logits = chain(repetition(1.3, p), presence_frequency(0.5, 0))(
                hf_logits(target_dir, p + out).clone(), out)
            want = filtered_logprobs(logits, 0.7, 40, 0.9)[token]
            assert lp == pytest.approx(float(want), abs=1e-4)
        assert o.cumulative_logprob == pytest.approx(sum(o.logprobs), abs=1e-5)


@pytest.mark.parametrize("spec", [None, "draft_target_self"])
def test_streamed_logprobs_follow_the_tokens(make_llm, spec):
    llm = make_llm(spec)
    p = prompts(1)[0]
    whole = llm.generate(p, greedy(logprobs=True))[0]
    deltas = list(llm.stream(p, greedy(logprobs=True)))
    assert [len(d.new_logprobs) for d in deltas] == [len(d.new_token_ids) for d in deltas]
    assert [x for d in deltas for x in d.new_logprobs] == whole.logprobs
    assert deltas[-1].cumulative_logprob == pytest.approx(sum(whole.logprobs), abs=1e-5)
    plain = list(llm.stream(p, greedy()))
    assert all(d.new_logprobs == [] and d.cumulative_logprob is None for d in plain)


# -- plain requests do not notice -----------------------------------------------------------------

@pytest.mark.parametrize("spec", [None, "draft_target_self", "mtp"])
def test_plain_requests_in_a_mixed_batch_get_exactly_their_plain_tokens(make_llm, spec):
    ps = prompts(5)
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, seed=21)
    plain = [greedy(), greedy(), sampled, greedy(), greedy()]
    alone = make_llm(spec).generate(ps, plain)
    controlled = [greedy(repetition_penalty=2.0, bad_words=["okenizer"], logprobs=True),
                  SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=3, min_tokens=10,
                                 frequency_penalty=2.0, logit_bias={5: 5.0})]
    mixed = make_llm(spec).generate(ps, [plain[0], controlled[0], plain[2], controlled[1],
                                         plain[4]])
    assert [mixed[i].token_ids for i in (0, 2, 4)] == [alone[i].token_ids for i in (0, 2, 4)]
    assert mixed[1].token_ids != alone[1].token_ids       # the controls did act in that batch


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5, frequency_penalty=0.5),
                                dict(logit_bias={17: 4.0, 183: -100.0}, bad_words=["okenizer"])])
def test_drafts_follow_the_controls_so_self_speculation_still_accepts(make_llm, kw):
    """The proposer drafts from the controlled logits too: the target drafting for
    itself keeps nearly every draft (from raw logits it would lose most)."""
    llm = make_llm("draft_target_self")
    llm.generate(prompts(), greedy(**kw))
    assert llm.engine.spec_metrics.acceptance_rate >= 0.95


def test_a_plain_batch_never_reaches_the_logits_processors(make_llm, monkeypatch):
    from tandem.backends.engine import outputs, step_controls

    def forbidden(*args, **kwargs):
        raise AssertionError("logits processing ran for plain requests")
    monkeypatch.setattr(step_controls, "apply_controls", forbidden)
    monkeypatch.setattr(outputs, "sampling_logprobs", forbidden)
    for spec in (None, "draft_target_self"):
        outs = make_llm(spec).generate(prompts(), [greedy(), SamplingParams(max_tokens=8, seed=1),
                                                   greedy(ignore_eos=True)])
        assert all(o.token_ids and o.finish_reason in ("stop", "length") for o in outs)
    # min_tokens alone stops costing anything once reached, and costs nothing without
    # stop ids to mask
    llm = make_llm(None)
    seq = llm.engine.make_sequence(prompts(1)[0], greedy(min_tokens=1))
    assert seq.controls.active(0) and not seq.controls.active(1)
    assert llm.engine.make_sequence(prompts(1)[0], greedy(min_tokens=1, ignore_eos=True)).controls \
        is None


# -- the batched maths against the hand reference --------------------------------------------

@pytest.mark.parametrize("n, m", [(1, 0), (4, 3), (1, 2), (2, 3)])
def test_apply_controls_matches_the_hand_reference_at_every_position(n, m):
    """Rows with different controls and output lengths (an empty output, one shorter
    than a bad word's prefix), ``m`` tokens ahead of which position j sees the first
    ``m - n + 1 + j``; the row without controls is not touched."""
    v = 12
    g = torch.Generator().manual_seed(n * 10 + m)
    logits = torch.randn(4, n, v, generator=g) * 3
    drafts = torch.randint(0, v, (4, m), generator=g) if m else None
    outputs = [[4, 5], [4], [5, 6, 5, 7], []]
    bans = [[(3,), (4, 5, 6), (2, 4, 5, 9)], [], [(7, 8), (6, 5, 7, 1)], [(9, 9, 2)]]
    stops = frozenset({0, 11})
    params = [SamplingParams(min_tokens=2, repetition_penalty=1.7, logit_bias={1: 2.0}),
              None,
              SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, min_tokens=6),
              SamplingParams(logit_bias={2: 5.0, 9: -1.0})]
    prompts_ = [[1, 2], [3], [2, 2, 8], [10]]
    rows = [0, 2, 3]
    controls = []
    for i in rows:
        c = LogitsControls.build(params[i], prompts_[i], stops, v, bans[i])
        for t in outputs[i]:
            c.append(t)
        controls.append(c)
    got = apply_controls(logits.clone(), rows, controls, [outputs[i] for i in rows], drafts)
    assert torch.equal(got[1], logits[1])
    for i in rows:
        for j in range(n):
            out = outputs[i] + (drafts[i, :m - n + 1 + j].tolist() if m else [])
            want = hand_process(logits[i, j], out, prompts_[i], params[i], bans[i], stops)
            torch.testing.assert_close(got[i, j], want)


# -- speculation keeps the sampled distribution ----------------------------------------------

def hand_distribution(base_logits, out, prompt, params, bans, stop_ids):
    return (hand_process(base_logits, out, prompt, params, bans, stop_ids)
            / params.temperature).softmax(-1)


def test_verification_with_controls_keeps_the_plain_distribution():
    """Rejection sampling of greedy drafts against the per-position processed target:
    the first token follows the plain step's distribution, and each later one the plain
    distribution given the tokens before it (checked where the drafts were accepted)."""
    v, k, n = 6, 2, 60000
    g = torch.Generator().manual_seed(0)
    base = torch.randn(k + 1, v, generator=g)
    base[0, 3] += 1.5
    base[1, 1] += 1.5
    params = SamplingParams(temperature=0.9, repetition_penalty=1.5, presence_penalty=0.4,
                            frequency_penalty=0.3, min_tokens=3, logit_bias={3: 0.7, 0: -0.5})
    prompt, out, bans, stops = [0, 5], [1], [(1, 2), (5,)], frozenset({4})
    controls = LogitsControls.build(params, prompt, stops, v, bans)
    controls.append(1)
    drafts = torch.tensor([[3, 1]])
    logits = base[None].clone()
    apply_controls(logits, [0], [controls], [out], drafts)
    # position j of the processed logits is the plain step after out + drafts[:j]
    for j in range(k + 1):
        want = hand_distribution(base[j], out + drafts[0, :j].tolist(), prompt, params, bans, stops)
        torch.testing.assert_close((logits[0, j] / params.temperature).softmax(-1), want)
    torch.manual_seed(0)
    verified, accepted = verify_drafts(logits.expand(n, -1, -1), drafts.expand(n, -1),
                                       [params] * n, [0] * n)
    first = verified[:, 0]
    p0 = hand_distribution(base[0], out, prompt, params, bans, stops)
    torch.testing.assert_close(torch.bincount(first.long(), minlength=v) / n, p0, atol=0.01, rtol=0)
    after = verified[first == 3, 1]
    p1 = hand_distribution(base[1], out + [3], prompt, params, bans, stops)
    torch.testing.assert_close(torch.bincount(after.long(), minlength=v) / len(after), p1,
                               atol=0.015, rtol=0)
    third = verified[(first == 3) & (verified[:, 1] == 1), 2]
    p2 = hand_distribution(base[2], out + [3, 1], prompt, params, bans, stops)
    assert len(third) > 3000
    torch.testing.assert_close(torch.bincount(third.long(), minlength=v) / len(third), p2,
                               atol=0.025, rtol=0)


@pytest.mark.parametrize("spec", ["draft_target", "draft_target_self", "mtp"])
def test_seeded_sampling_with_controls_is_reproducible_and_obeys_them(make_llm, spec):
    ps = prompts(3)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=8, min_tokens=12,
                            stop_token_ids=[7], bad_words=["okenizer"], frequency_penalty=1.0)
    llm = make_llm(spec)
    banned = {w[0] for w in vllm_bad_word_ids(llm.tokenizer, "okenizer")}
    batch = llm.generate(ps, params)
    alone = make_llm(spec).generate(ps[1], params)[0]
    assert batch[1].token_ids == alone.token_ids
    for o in batch:
        assert not banned & set(o.token_ids)
        assert not {7, EOS} & set(o.token_ids[:12]) and len(o.token_ids) > 12


# -- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field, allowed", [
    (dict(repetition_penalty=0.0), "repetition_penalty", "> 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty", "> 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty", "> 0"),
    (dict(presence_penalty=2.5), "presence_penalty", r"\[-2, 2\]"),
    (dict(frequency_penalty=-2.01), "frequency_penalty", r"\[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty", r"\[-2, 2\]"),
    (dict(min_tokens=-1), "min_tokens", "an integer in"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens", "max_tokens=16"),
    (dict(min_tokens=1.5), "min_tokens", "an integer"),
    (dict(bad_words=["ok", ""]), "bad_words", "non-blank strings"),
    (dict(bad_words="okenizer"), "bad_words", "a list"),
    (dict(logit_bias={-1: 1.0}), "logit_bias", "token id"),
    (dict(logit_bias={"5": 1.0}), "logit_bias", "token id"),
    (dict(logit_bias={5: float("inf")}), "logit_bias", "finite"),
    (dict(logprobs=1), "logprobs", "true or false"),
])
def test_bad_values_are_refused_naming_the_field(kw, field, allowed):
    with pytest.raises(ValueError, match=rf"^{field}=.*allowed: .*{allowed}"):
        SamplingParams(**kw).validate()


def test_engine_checks_ids_against_the_vocabulary(make_llm, checkpoint_root):
    llm = make_llm(None)
    with pytest.raises(ValueError, match=r"logit_bias .*\[384\].*0\.\.383"):
        llm.generate(prompts(1)[0], greedy(logit_bias={3: 1.0, 384: 2.0}))
    no_tokenizer = LLM(make_checkpoint("llama_gqa_untied", checkpoint_root))
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        no_tokenizer.generate(prompts(1)[0], greedy(bad_words=["x"]))
    assert not llm.engine.has_unfinished() and not no_tokenizer.engine.has_unfinished()


def test_a_fully_banned_row_fails_alone(make_llm):
    """Banning every token leaves nothing to sample: that request ends with an error
    naming the cause; the others are untouched."""
    llm = make_llm(None)
    ps = prompts(2)
    want = llm.generate(ps[0], greedy())[0].token_ids
    everything = {t: 0.0 for t in range(384)}
    seqs = [llm.engine.make_sequence(ps[0], greedy()),
            llm.engine.make_sequence(ps[1], greedy(logit_bias=everything))]
    seqs[1].controls.bad_words = [(t,) for t in range(384)]
    for s in seqs:
        llm.engine.add(s)
    finals = {}
    while llm.engine.has_unfinished():
        finals.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert finals[seqs[1].request_id].finish_reason == "error"
    assert "no finite value" in finals[seqs[1].request_id].error
    assert seqs[0].output_ids == want
