"""The benchmarks' request client without a server: recorded streams of both servers
parsed however their bytes are split (completions and chat), the request bodies, and
what a request's output says (TTFT, gaps, tokens)."""
from __future__ import annotations

import json

import pytest

from tandem.client.bench.request_client import RequestInput, RequestOutput, openai_body
from tandem.client.bench.sse import ChunkedDecoder, SSEParser, parse_event

# what vLLM 0.32's /v1/completions streams with stream_options.include_usage
VLLM_STREAM = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"tandem","choices":[{"index":0,'
    b'"text":" def","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}\n\n'
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"tandem","choices":[{"index":0,'
    b'"text":" f","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":null}\n\n'
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"tandem","choices":[],'
    b'"usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2}}\n\n'
    b'data: [DONE]\n\n')
# what Tandem's frontend streams (no usage key in content chunks, CRLF as some proxies send)
TANDEM_STREAM = (
    b'data: {"id":"cmpl-2","object":"text_completion","created":1,"model":"tandem","choices":[{"index":0,'
    b'"text":" def","logprobs":null,"finish_reason":null}]}\r\n\r\n'
    b': keep-alive comment\r\n\r\n'
    b'data: {"id":"cmpl-2","object":"text_completion","created":1,"model":"tandem","choices":[{"index":0,'
    b'"text":" f","logprobs":null,"finish_reason":"length"}]}\r\n\r\n'
    b'data: {"id":"cmpl-2","object":"text_completion","created":1,"model":"tandem","choices":[],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\r\n\r\n'
    b'data: [DONE]\r\n\r\n')


def events(stream: bytes, step: int) -> list:
    parser = SSEParser()
    out = []
    for i in range(0, len(stream), step):
        out += [parse_event(p) for p in parser.feed(stream[i:i + step])]
    return out


@pytest.mark.parametrize("stream", [VLLM_STREAM, TANDEM_STREAM], ids=["vllm", "tandem"])
@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_both_servers_streams_parse_alike_however_split(stream, step):
    evs = events(stream, step)
    assert [e.text for e in evs[:3]] == [" def", " f", ""]
    assert evs[1].finish_reason == "length"
    assert evs[2].completion_tokens == 2
    assert evs[3] is None          # [DONE]
    assert len(evs) == 4           # the comment carries no payload


def test_an_error_inside_the_stream_is_an_error_event():
    ev = parse_event(json.dumps({"error": {"message": "boom", "type": "internal"}}))
    assert ev.error == "boom" and ev.text == ""


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_chunked_body_decodes_across_splits(step):
    raw = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n"
    d, out = ChunkedDecoder(), b""
    for i in range(0, len(raw), step):
        out += d.feed(raw[i:i + step])
    assert out == b"hello, world" and d.done


# what Tandem's frontend streams for /v1/chat/completions: the role first, then content
# deltas, an empty delta with the finish reason, the usage
TANDEM_CHAT_STREAM = (
    b'data: {"id":"chatcmpl-3","object":"chat.completion.chunk","created":1,"model":"tandem","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-3","object":"chat.completion.chunk","created":1,"model":"tandem","choices":[{"index":0,'
    b'"delta":{"content":" def"},"logprobs":null,"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-3","object":"chat.completion.chunk","created":1,"model":"tandem","choices":[{"index":0,'
    b'"delta":{"content":" f"},"logprobs":null,"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-3","object":"chat.completion.chunk","created":1,"model":"tandem","choices":[{"index":0,'
    b'"delta":{},"logprobs":null,"finish_reason":"length"}]}\n\n'
    b'data: {"id":"chatcmpl-3","object":"chat.completion.chunk","created":1,"model":"tandem","choices":[],'
    b'"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}\n\n'
    b'data: [DONE]\n\n')


@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_a_chat_stream_parses_its_deltas_however_split(step):
    evs = events(TANDEM_CHAT_STREAM, step)
    assert [e.text for e in evs[:4]] == ["", " def", " f", ""]      # the role chunk carries no text
    assert evs[3].finish_reason == "length" and evs[4].completion_tokens == 2 and evs[4].prompt_tokens == 9
    assert evs[5] is None and len(evs) == 6


def test_bodies_of_completions_and_chat():
    inp = RequestInput("def f():", 8, kind="cold", model="m", min_tokens=8, ignore_eos=True)
    completion, chat = openai_body(inp), openai_body(inp, chat=True)
    assert completion["prompt"] == "def f():" and "messages" not in completion
    assert chat["messages"] == [{"role": "user", "content": "def f():"}] and "prompt" not in chat
    for b in (completion, chat):
        assert (b["model"], b["max_tokens"], b["min_tokens"], b["temperature"]) == ("m", 8, 8, 0.0)
        assert b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] is True
    plain = openai_body(RequestInput("p", 4))
    assert "min_tokens" not in plain and "ignore_eos" not in plain


def test_an_output_times_its_chunks():
    sse = RequestOutput("cold", chunk_s=[0.1, 0.2, 0.4], output_tokens=4)       # a chunk of two tokens
    assert sse.ttft_s == 0.1 and sse.itl_s == pytest.approx([0.1, 0.2]) and sse.tokens == 4
    assert sse.decode_tokens_per_s() is None                                    # SSE says no count per chunk
    grpc = RequestOutput("long", chunk_s=[0.5, 0.6, 0.8], chunk_tokens=[1, 2, 1])
    assert grpc.tokens == 4 and grpc.decode_tokens_per_s() == pytest.approx(3 / 0.3)
    assert RequestOutput("cold", chunk_s=[0.1, 0.2]).tokens == 2                # no usage: the chunks
    nothing = RequestOutput("cold", error="HTTP 500")
    assert nothing.ttft_s is None and nothing.itl_s == [] and nothing.tokens == 0
