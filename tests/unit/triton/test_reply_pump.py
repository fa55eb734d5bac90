"""The reply pump (backends/triton/reply_pump.py): a stream behind its sender gets its
steps in one response, every token once, in order."""

from __future__ import annotations

import time
import types

import pytest

from .fakes import FINAL, FakeEngine, SlowSender, TritonError
from .model_calls import outputs, texts, token_request


def step(i, reason=None, index=0, logprob=None):
    """Engine output of step ``i`` (token 10 + i, text " t<i>")."""
    return types.SimpleNamespace(
        request_id=f"req-{index}", new_token_ids=[10 + i], new_text=f" t{i}", finished=reason is not None,
        finish_reason=reason, num_prompt_tokens=3, num_output_tokens=i + 1,
        new_logprobs=None if logprob is None else [logprob], cumulative_logprob=-0.5 * (i + 1))


def slow_request(**extra):
    request = token_request(**extra)
    request.sender = SlowSender()
    return request


def test_steps_queued_behind_a_busy_sender_arrive_in_one_response_each_token_once(model):
    """The first token goes out at once; the steps made while the server was slow to take
    it come merged in one response: every token once, in order, the counts and finish
    reason of the last step, final on the last response only."""
    engine = FakeEngine.instances[-1]
    request = slow_request(stream=True, max_tokens=5, return_log_probs=True)
    model.execute([request])
    _, _, on_output = engine.submitted[0]
    on_output(step(0, logprob=-0.5))
    assert request.sender.sending.wait(5)           # the first reply is being sent, not held back
    for i in range(1, 5):
        on_output(step(i, reason="length" if i == 4 else None, logprob=-0.5))
    request.sender.release.set()
    assert model.replies.flush()
    sent = outputs(request.sender)
    assert [o["output_ids"].tolist() for o, _ in sent] == [[[10]], [[11, 12, 13, 14]]]
    assert texts(request.sender) == [" t0", " t1 t2 t3 t4"]
    assert [o["finish_reason"][0, 0] for o, _ in sent] == [b"", b"length"]
    assert [int(o["num_output_tokens"][0, 0]) for o, _ in sent] == [1, 5]
    assert sent[1][0]["output_log_probs"].tolist() == [[[-0.5] * 4]]
    assert float(sent[1][0]["cum_log_probs"][0, 0]) == -2.5
    assert [bool(flags & FINAL) for _, flags in sent] == [False, True]
    assert len(model.in_flight) == 0


def test_samples_are_not_merged_with_each_other(model):
    engine = FakeEngine.instances[-1]
    request = slow_request(stream=True, num_return_sequences=2, max_tokens=2)
    model.execute([request])
    on = [engine.submitted[i][2] for i in range(2)]
    on[0](step(0))
    assert request.sender.sending.wait(5)
    on[1](step(0, index=1))
    on[1](step(1, "stop", index=1))      # merges with sample 1's first step
    on[0](step(1, "length"))
    request.sender.release.set()
    assert model.replies.flush()
    sent = outputs(request.sender)
    assert [(int(o["sequence_index"][0, 0]), o["output_ids"].tolist()) for o, _ in sent] == [
        (0, [[10]]), (1, [[10, 11]]), (0, [[11]])]
    assert [bool(flags & FINAL) for _, flags in sent] == [False, False, True]


def test_an_error_after_queued_tokens_comes_after_them(model):
    engine = FakeEngine.instances[-1]
    request = slow_request(stream=True, max_tokens=5)
    model.execute([request])
    _, _, on_output = engine.submitted[0]
    on_output(step(0))
    assert request.sender.sending.wait(5)
    on_output(step(1))
    on_output(step(2, "error"))
    request.sender.release.set()
    assert model.replies.flush()
    assert texts(request.sender) == [" t0", " t1"]
    last, flags = request.sender.sent[-1]
    assert flags & FINAL and last.error.code() == TritonError.INTERNAL


@pytest.mark.parametrize("seed", range(4))
def test_the_pump_delivers_every_reply_once_in_order_whatever_the_timing(seed):
    """Many streams, a sender that takes random time: per stream, the tokens joined are
    the tokens put, in order; one final, last; fewer or as many responses as replies."""
    import random

    from tandem.backends.triton.reply_pump import ReplyPump
    from tandem.backends.triton.response_arrays import SequenceReply
    from tandem.backends.triton.response_stream import Reply

    rng = random.Random(seed)
    pump = ReplyPump()
    got: dict[int, list[Reply]] = {k: [] for k in range(6)}

    def sender(k):
        def send(reply):
            if rng.random() < 0.3:
                time.sleep(0.001)
            got[k].append(reply)
        return send

    boxes = {k: pump.outbox(sender(k)) for k in got}
    lengths = {k: rng.randint(1, 40) for k in got}
    made = {k: 0 for k in got}
    try:
        while any(made[k] < lengths[k] for k in got):
            k = rng.choice([k for k in got if made[k] < lengths[k]])
            i, last = made[k], made[k] == lengths[k] - 1
            boxes[k].put(Reply(sequence=SequenceReply([i], f"<{i}>", "stop" if last else None, 1, i + 1),
                               final=last))
            made[k] += 1
            if rng.random() < 0.2:
                time.sleep(0.0005)
        assert pump.flush()
    finally:
        pump.close()
    for k, replies in got.items():
        assert [t for r in replies for t in r.sequence.token_ids] == list(range(lengths[k]))
        assert "".join(r.sequence.text for r in replies) == "".join(f"<{i}>" for i in range(lengths[k]))
        assert [r.final for r in replies] == [False] * (len(replies) - 1) + [True]
        assert replies[-1].sequence.num_output_tokens == lengths[k]
    assert pump.sent <= pump.replies == sum(lengths.values())
