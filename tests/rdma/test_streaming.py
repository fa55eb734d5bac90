"""Layer-wise streaming: the messenger ships a layer's pages as soon as the forward
reports the layer done, so with slow layers the first layer is complete on the
decode side long before the last layer has been computed."""
from __future__ import annotations

from tandem.rdma import DestinationDescriptor, ModelSpec
from tandem.rdma.shared_pool import READY

LAYERS = 8


def test_first_layer_lands_before_the_last_layer_is_computed(make_pool, rx, tx0):
    spec = ModelSpec("target", LAYERS, 4, 16, 16, "bfloat16", "HND")
    pool = make_pool([spec], num_pages=32)
    rx("rx_start", pool.spec.name)
    tx0("tx_start", [spec], 64, rank=0)
    d = DestinationDescriptor.from_bytes(rx("rx_reserve", 100, max_run_pages=4))
    [res] = tx0("tx_run", [(d.to_bytes(), list(range(10, 17)))], layer_delay_s=0.05,
                context=False)
    state, completed, expected, _ = rx("rx_wait", d.slot, d.generation)
    assert res["error"] is None and state == READY and completed == expected
    trace = rx("rx_trace", d.slot, d.generation)
    computed = res["layer_computed_at"]
    landed = trace["layer_done_at"]
    # timestamps are time.monotonic(): one clock for every process on the host
    assert landed[("target", 0)] < computed[("target", LAYERS - 1)]
    for layer in range(LAYERS):
        assert landed[("target", layer)] >= computed[("target", layer)]
    # most layers were on the decoder before the forward finished
    early = sum(landed[("target", k)] < computed[("target", LAYERS - 1)] for k in range(LAYERS))
    assert early >= LAYERS // 2
    assert trace["ready_at"] >= computed[("target", LAYERS - 1)]
    pool.free(pool.claim(d.slot, d.generation))


def test_chunked_prefill_streams_each_chunk_and_ends_exact(make_pool, rx, tx0):
    """Chunks announced before they run: pages completed by a chunk go out with that
    chunk's layers; a page straddling two chunks goes out once, after the second."""
    spec = ModelSpec("target", 4, 2, 8, 4, "float32", "NHD")
    pool = make_pool([spec], num_pages=64)
    rx("rx_start", pool.spec.name)
    tx0("tx_start", [spec], 64, rank=0)
    d = DestinationDescriptor.from_bytes(rx("rx_reserve", 50, max_run_pages=1))
    [res] = tx0("tx_run", [(d.to_bytes(), list(range(13)))], chunk_tokens=6, context=False)
    state, completed, expected, _ = rx("rx_wait", d.slot, d.generation)
    assert state == READY and completed == expected == 13 * 4 == res["sent"]
    pool.free(pool.claim(d.slot, d.generation))
