"""Structured output: guides compile once and refuse clearly; sampled at temperature 1
(the demo model would never write JSON by itself) every output is valid, with and
without each speculation method; verification keeps the grammar-masked target
distribution at every position."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tandem.backends import LLM, SamplingParams, SpeculativeConfig
from tandem.backends.engine.guided import GuideCompiler, GuideError, bitmask_words, fill_guides, mask_logits
from tandem.backends.engine.params import GuidedDecoding
from tandem.backends.engine.sampler import verify_drafts
from tandem.backends.models.tokenizer import load_tokenizer

from ...guided_outputs import REGEX, valid

pytest.importorskip("xgrammar")
DEMO = Path(__file__).resolve().parents[3] / "checkpoints" / "demo"
VOCAB = 4096
EOS = 1


def apply_guides(logits: torch.Tensor, rows: list[int], guides: list, drafts: torch.Tensor | None = None):
    """The guided ``rows`` of ``logits`` [B, n, V] masked in place as the engine's step
    masks them (fill the bitmasks, then mask); returns the dead positions."""
    b, n, v = logits.shape
    ahead = drafts[rows].tolist() if drafts is not None else [[] for _ in rows]
    return mask_logits(logits, fill_guides(b, n, v, rows, guides, ahead))

SCHEMA = {"type": "object", "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
EBNF = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [0-9] | [1-9] [0-9]'   # its language: guided_outputs.SUMS
GUIDES = {"json_schema": GuidedDecoding("json_schema", json.dumps(SCHEMA)),
          "regex": GuidedDecoding("regex", REGEX),
          "ebnf_grammar": GuidedDecoding("ebnf_grammar", EBNF),
          "json": GuidedDecoding("json")}


@pytest.fixture(scope="module")
def compiler():
    return GuideCompiler(load_tokenizer(DEMO / "target"), VOCAB, [EOS])


# -- compiling ----------------------------------------------------------------------------

@pytest.mark.parametrize("guide,reason", [
    (GuidedDecoding("json_schema", '{"type": "nonsense"}'), 'Unsupported type "nonsense"'),
    (GuidedDecoding("json_schema", "not json"), "Failed to parse JSON"),
    (GuidedDecoding("regex", "([a-z]"), "Regex parsing error"),
    (GuidedDecoding("ebnf_grammar", "root ::= "), "EBNF parser error"),
])
def test_a_bad_guide_is_refused_naming_the_field_with_xgrammars_reason(compiler, guide, reason):
    with pytest.raises(GuideError) as e:
        compiler.compile(guide)
    message = str(e.value)
    assert message.startswith("guided_decoding_guide: ") and reason in message, message
    assert "/project/cpp" not in message and "\n" not in message
    with pytest.raises(GuideError, match=re.escape(reason)):   # the failure is remembered
        compiler.compile(guide)


def test_each_guide_compiles_once(compiler):
    guide = GuidedDecoding("regex", "[0-9]{3}-once")
    before = compiler.compiles
    first = compiler.compile(guide)
    assert compiler.compile(GuidedDecoding("regex", "[0-9]{3}-once")) is first
    assert compiler.compiles == before + 1


def test_a_compile_past_the_time_bound_is_refused(compiler):
    slow = GuideCompiler(compiler.tokenizer, VOCAB, [EOS], timeout_s=1e-4)
    with pytest.raises(GuideError, match="did not compile within"):
        slow.compile(GuidedDecoding("json_schema", json.dumps(SCHEMA)))


@pytest.mark.parametrize("kw,match", [
    (dict(guide_type="yaml"), "guided_decoding_guide_type='yaml' is invalid"),
    (dict(guide_type="regex", guide=""), "guided_decoding_guide is empty"),
])
def test_bad_guided_decoding_params_are_refused(kw, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        SamplingParams(guided_decoding=GuidedDecoding(**kw)).validate()


# -- masks ----------------------------------------------------------------------------------

def allowed_after(compiler, guide: GuidedDecoding, prefix: list[int]) -> torch.Tensor:
    """[V] bool: the tokens the grammar takes after ``prefix``, found by trying each."""
    state = compiler.matcher(guide, [EOS])
    for t in prefix:
        state.accept(t)
    m = state.matcher
    ok = torch.zeros(VOCAB, dtype=torch.bool)
    for t in range(VOCAB):
        if m.accept_token(t):
            ok[t] = True
            m.rollback(1)
    return ok


def test_fill_masks_each_position_after_the_drafts_before_it_and_leaves_the_matcher(compiler):
    tok = load_tokenizer(DEMO / "target")
    guide = GuidedDecoding("regex", "ab[0-9]+")
    a, b = tok.token_to_id("a"), tok.token_to_id("b")
    state = compiler.matcher(guide, [EOS])
    bitmask = torch.zeros(3, bitmask_words(VOCAB), dtype=torch.int32)
    reachable = state.fill(bitmask, 0, [a, b], 3)
    assert reachable == [True, True, True]
    bits = ((bitmask[:, :, None] >> torch.arange(32)) & 1).bool().flatten(1)[:, :VOCAB]
    for j, prefix in enumerate([[], [a], [a, b]]):
        assert torch.equal(bits[j], allowed_after(compiler, guide, prefix)), j
    # a draft the grammar forbids makes the positions after it unreachable
    assert state.fill(bitmask, 0, [b, a], 3) == [True, False, False]
    state.accept(a)           # the fills rolled the matcher back: "a" is still next
    state.accept(b)


def test_verification_keeps_the_grammar_masked_target_distribution(compiler):
    """Position j of the verified tokens follows the target's distribution masked by the
    grammar after the output and drafts[:j]; a draft the grammar forbids is never kept."""
    tok = load_tokenizer(DEMO / "target")
    guide = GuidedDecoding("regex", "(ab|a|b)[0-9]")
    a, b, one, x = (tok.token_to_id(t) for t in ("a", "b", "1", "x"))
    k, n = 3, 12000
    g = torch.Generator().manual_seed(0)
    base = torch.randn(k + 1, VOCAB, generator=g)
    for t in (a, b, one, x, tok.token_to_id("ab"), tok.token_to_id("2")):
        base[:, t] += 6.0          # mass on tokens the grammar cares about
    drafts = torch.tensor([[a, b, x]])      # x is never allowed after "ab"
    logits = base[None].clone()
    state = compiler.matcher(guide, [EOS])
    dead = apply_guides(logits, [0], [state], drafts)
    assert dead == {}
    masked = [torch.where(allowed_after(compiler, guide, drafts[0, :j].tolist()), base[j], -torch.inf)
              for j in range(k)]
    for j in range(k):
        torch.testing.assert_close(logits[0, j].softmax(-1), masked[j].softmax(-1))
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0)
    chunk = 2000       # vocabulary-sized one-hot drafts: bounded memory
    runs = [verify_drafts(logits.expand(chunk, -1, -1), drafts.expand(chunk, -1), [params] * chunk,
                          [0] * chunk) for _ in range(n // chunk)]
    verified = torch.cat([v for v, _ in runs])
    accepted = [a for _, acc in runs for a in acc]
    first = verified[:, 0].long()
    torch.testing.assert_close(torch.bincount(first, minlength=VOCAB).float() / n,
                               masked[0].softmax(-1), atol=0.02, rtol=0)
    after = verified[first == a, 1].long()
    assert len(after) > 1500
    torch.testing.assert_close(torch.bincount(after, minlength=VOCAB).float() / len(after),
                               masked[1].softmax(-1), atol=0.035, rtol=0)
    third = verified[(first == a) & (verified[:, 1] == b), 2].long()
    assert len(third) > 500 and not (third == x).any()
    torch.testing.assert_close(torch.bincount(third, minlength=VOCAB).float() / len(third),
                               masked[2].softmax(-1), atol=0.06, rtol=0)
    assert max(accepted) <= 2


# -- the engine -----------------------------------------------------------------------------

SPECS = {"none": None,
         "draft_target": SpeculativeConfig("draft_target", 3, draft_model=str(DEMO / "draft")),
         "mtp": SpeculativeConfig("mtp", 3, mtp_head=str(DEMO / "mtp")),
         "ngram": SpeculativeConfig("ngram", 3)}
PROMPTS = ["def main():", "import os\n", "class Path:", "# the answer is"]


@pytest.fixture(scope="module", params=list(SPECS))
def demo_llm(request):
    return request.param, LLM(str(DEMO / "target"), dtype="float32", page_size=4,
                              speculative=SPECS[request.param])


@pytest.mark.parametrize("kind", list(GUIDES))
def test_every_sampled_output_is_valid(demo_llm, kind):
    method, llm = demo_llm
    n = 12
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(n)],
                        SamplingParams(max_tokens=48 if kind != "json" else 160, temperature=1.0,
                                       seed=None, guided_decoding=GUIDES[kind]))
    finished = [o for o in outs if o.finish_reason == "stop"]
    # any JSON value may be a string or number as long as max_tokens: those are cut short
    assert len(finished) >= (n if kind != "json" else n // 3), [(o.text, o.finish_reason) for o in outs]
    bad = [o.text for o in finished if not valid(kind, o.text, SCHEMA)]
    assert bad == [], (method, kind, bad)
    assert all(o.token_ids[-1] == EOS for o in finished)


def test_guides_with_penalties_bad_words_stop_words_and_several_samples(demo_llm):
    method, llm = demo_llm
    params = SamplingParams(max_tokens=48, temperature=1.0, repetition_penalty=1.3,
                            presence_penalty=0.5, bad_words=["com"], stop=["zz"],
                            guided_decoding=GUIDES["regex"])
    outs = llm.generate(PROMPTS * 2, params)
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
        assert "@" in o.text
    # an unguided request in the same batch is untouched by the guide
    mixed = llm.generate(["def main():", "def main():"],
                         [SamplingParams(max_tokens=8, temperature=0.0),
                          SamplingParams(max_tokens=48, temperature=0.0, guided_decoding=GUIDES["regex"])])
    plain = llm.generate(["def main():"], SamplingParams(max_tokens=8, temperature=0.0))
    assert mixed[0].token_ids == plain[0].token_ids
    assert re.fullmatch(REGEX, mixed[1].text)


def test_greedy_guided_output_is_the_same_with_speculation(demo_llm):
    method, llm = demo_llm
    reference = _plain_llm().generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0,
                                                               guided_decoding=GUIDES["json_schema"]))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0,
                                                guided_decoding=GUIDES["json_schema"]))
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference], method


_PLAIN = []


def _plain_llm():
    if not _PLAIN:
        _PLAIN.append(LLM(str(DEMO / "target"), dtype="float32", page_size=4))
    return _PLAIN[0]


def test_a_guide_left_without_a_token_ends_the_sequence_with_the_reason(demo_llm):
    """min_tokens bans EOS, the only token a complete regex allows: a complete output
    ends "stop"; a grammar whose only continuation is banned ends with an error."""
    method, llm = demo_llm
    out = llm.generate("x", SamplingParams(max_tokens=20, temperature=1.0, min_tokens=10,
                                           guided_decoding=GuidedDecoding("regex", "yes")))[0]
    assert out.text == "yes" and out.finish_reason == "stop"
    # every token the regex can start with is a bad word
    last = list(llm.stream("x", SamplingParams(max_tokens=20, temperature=1.0,
                                               bad_words=["y", "ye", "yes"],
                                               guided_decoding=GuidedDecoding("regex", "yes"))))[-1]
    assert last.finish_reason == "error" and "the guide allows no token" in last.error, last
