"""The local prefill takes decode's cores while decode holds no sequence (PrefillThreads),
read from the board decode publishes after every step."""
from tandem.backends.disagg.decode_load import DecodeLoadBoard, PrefillThreads


def test_prefill_uses_the_idle_threads_while_decode_holds_no_sequence(tmp_path):
    board = DecodeLoadBoard("test-prefill-threads", create=True)
    try:
        calls = []
        hook = PrefillThreads("test-prefill-threads", threads=1, idle_threads=2, set_threads=calls.append)
        board.publish(0, running=3)
        hook()
        board.publish(0, running=0)
        hook()
        hook()                       # unchanged: no call
        board.publish(0, running=1)
        hook()
        assert calls == [1, 2, 1]
    finally:
        board.close(unlink=True)


def test_until_decode_made_its_board_prefill_keeps_its_share():
    calls = []
    hook = PrefillThreads("no-such-board", threads=1, idle_threads=2,
                          open_board=lambda name: None, set_threads=calls.append)
    hook()
    assert calls == [1]


def test_without_idle_threads_nothing_changes():
    calls = []
    PrefillThreads("any", threads=2, idle_threads=2, open_board=lambda name: None, set_threads=calls.append)()
    assert calls == []
