"""A request's response stream (backends/triton/response_stream.py) and Triton's
cancellation check."""

from __future__ import annotations

import time


def test_cancellation_is_never_asked_while_or_after_the_final_reply_goes_out():
    """The Python backend frees a decoupled request's response factory with its final
    response; ``is_cancelled()`` after that crashed the server (use after free)."""
    import threading

    from tandem.backends.triton.generate_request import GenerateRequest
    from tandem.backends.triton.response_stream import ResponseStream

    sending, release = threading.Event(), threading.Event()

    def slow_send(reply):
        sending.set()
        release.wait(5)

    stream = ResponseStream(GenerateRequest([1], stream=True), slow_send)
    asked = []
    assert stream.client_cancelled(lambda: asked.append(1) or False) is False and asked == [1]
    final = threading.Thread(target=stream.fail, args=("boom",))
    final.start()
    sending.wait(5)
    answer = []
    poll = threading.Thread(target=lambda: answer.append(stream.client_cancelled(lambda: asked.append(2))))
    poll.start()
    time.sleep(0.05)
    assert answer == []              # waits for the final send to finish
    release.set()
    final.join(5)
    poll.join(5)
    assert answer == [False] and asked == [1]
