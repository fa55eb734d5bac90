"""The messenger on the engine's own forward: a real (tiny, random) Llama runs chunked
prefill through ModelRunner with ``on_layer_done=step.layer_done``; the decoder then
continues from the transferred KV and gets the same logits as prefill's own cache."""
from __future__ import annotations

import pytest

from tandem.rdma import KVReceiver, KVSender, ModelSpec

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_decode_continues_from_transferred_kv(layout, make_pool):
    torch.set_num_threads(1)
    from tandem.backends.disagg.kv_views import shared_page_pool, source_pool
    from tandem.backends.engine.model_runner import ForwardBatch, ModelRunner
    from tandem.backends.kv_cache import KVPagePool
    from tandem.backends.models.config import ModelConfig
    from tandem.backends.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8)
    model = LlamaForCausalLM(cfg).eval()
    prompt = torch.randint(0, 64, (11,)).tolist()
    n = len(prompt) - 1                      # prefill stops before the last prompt token
    prefill_pool = KVPagePool(3, 16, 2, 4, 8, torch.float32, layout)
    src_pages = [9, 4, 5]
    pool = make_pool([ModelSpec("target", 3, 2, 8, 4, "float32", layout)], num_pages=8,
                     context_bytes=4 * cfg.hidden_size)
    rx, tx = KVReceiver(pool), KVSender({"target": source_pool("target", prefill_pool)})
    try:
        d = rx.reserve(n, context_nbytes=(4 * cfg.hidden_size,))
        t = tx.begin(d, src_pages)
        runner = ModelRunner(model, prefill_pool)
        for start, end in ((0, 6), (6, n)):   # chunked prefill, each chunk announced first
            step = tx.step("target", {t: end})
            batch = ForwardBatch([prompt[start:end]], [start], [src_pages])
            _, hidden = runner.forward(batch, on_layer_done=step.layer_done)
        tx.send_context(t, [hidden[-1].contiguous()])   # penultimate token's hidden state
        t.wait(10)
        assert rx.wait(d.slot, d.generation, 10).ready
        pages = pool.claim(d.slot, d.generation)
        assert sorted(pages) == sorted(d.page_ids)
        ctx = torch.frombuffer(bytearray(pool.context(d.slot).tobytes()), dtype=torch.float32)
        assert torch.equal(ctx, hidden[-1])
        # the decoder treats the last prompt token as a decode token
        decode_pool = shared_page_pool(pool, 0, "target")
        last = ForwardBatch([[prompt[-1]]], [n], [list(d.page_ids)])
        _, h_decode = ModelRunner(model, decode_pool).forward(last)
        _, h_local = runner.forward(ForwardBatch([[prompt[-1]]], [n], [src_pages]))
        assert torch.equal(h_decode, h_local)
        pool.free(pages)
    finally:
        rx.close()
        tx.close()
