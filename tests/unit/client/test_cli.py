"""The ``tandem`` command: a user's mistake is one clear line and exit code 2."""
from tandem.client.cli import main


def test_a_wrong_path_is_a_message_not_a_traceback(tmp_path, capsys):
    assert main(["train", "mtp", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem train: ") and "nope" in err and "Traceback" not in err


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    import pytest
    monkeypatch.setenv("TANDEM_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(["train", "mtp", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
