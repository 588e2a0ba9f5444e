"""Library log records go to a file, not the terminal, unless log_level=debug (maxpar/io/logs.py)."""

from __future__ import annotations

import io
import sys
import logging
from collections.abc import Iterator

import pytest

from maxpar.io import logs


@pytest.fixture
def terminal(monkeypatch) -> Iterator[io.StringIO]:
    """The handler absl's first record installs in a fresh process (a plain StreamHandler, root level WARNING),
    printing into a buffer."""
    stream, level = io.StringIO(), logging.root.level
    monkeypatch.setattr(logging.root, "handlers", [*logging.root.handlers, logging.StreamHandler(stream)])
    logging.root.setLevel(logging.WARNING)  # setLevel, not setattr: it clears the loggers' cached levels
    yield stream
    logging.root.setLevel(level)


def log_like_orbax() -> None:
    """A read-only warning and a logged exception with its traceback, as Orbax writes them through absl."""
    library = logging.getLogger("absl")
    library.warning("Given directory is read only=/some/run/checkpoints")
    try:
        raise ValueError("Encountered error while reading array index")
    except ValueError:
        library.exception("_SignalingThread.run() raised an exception")
    library.debug("a debug record")


def test_library_records_go_to_the_file_and_never_to_the_terminal(terminal, tmp_path):
    handlers_before = list(logging.root.handlers)
    path = tmp_path / "run" / "libraries.log"
    with logs.library_logs(path, "info"):
        log_like_orbax()
    assert terminal.getvalue() == ""
    written = path.read_text()
    assert "WARNING absl" in written and "Given directory is read only" in written
    assert "Traceback (most recent call last)" in written and "Encountered error while reading array index" in written
    assert "a debug record" not in written
    # Afterwards the process logs as before.
    assert logging.root.handlers == handlers_before and logging.root.level == logging.WARNING
    logging.getLogger("absl").warning("after")
    assert terminal.getvalue() == "after\n"


def test_debug_shows_library_records_on_the_terminal_too(terminal, tmp_path):
    path = tmp_path / "libraries.log"
    with logs.library_logs(path, "debug"):
        log_like_orbax()
    for text in (terminal.getvalue(), path.read_text()):
        assert "Given directory is read only" in text and "Traceback (most recent call last)" in text
        assert "a debug record" in text


def test_no_library_record_means_no_file_and_no_directory(tmp_path):
    with logs.library_logs(tmp_path / "run" / "libraries.log", "info"):
        pass
    assert not (tmp_path / "run").exists()


def test_every_process_of_a_job_has_its_own_file(tmp_path):
    assert logs.library_log_path(tmp_path) == tmp_path / "libraries.log"
    assert logs.library_log_path(tmp_path, 1, 2) == tmp_path / "libraries.process_1.log"


class FailsWhenCollected:
    """An object whose finalizer raises: Python reports that through sys.unraisablehook, as it does for a future
    holding Orbax's read error that nobody awaited."""

    def __del__(self):
        raise ValueError("Encountered error while reading array index")


def test_an_exception_python_could_not_raise_goes_to_the_file(terminal, tmp_path, capsys):
    path = tmp_path / "libraries.log"
    hook = sys.unraisablehook
    with logs.library_logs(path, "info"):
        FailsWhenCollected()
    assert sys.unraisablehook is hook
    assert "reading array index" not in capsys.readouterr().err + terminal.getvalue()
    assert "ValueError: Encountered error while reading array index" in path.read_text()


def test_what_native_code_writes_on_stderr_goes_to_the_library_log(tmp_path, capfd):
    """TensorStore's C++ prints its credentials choice on file descriptor 2, below Python's sys.stderr (issue 43)."""
    import os
    path = tmp_path / "libraries.log"
    with logs.library_logs(path, "info"), logs.native_stderr_logged("tensorstore"):
        os.write(2, b"I1128 12:00:00.000000 1 google_auth_provider.cc:136] Using GOOGLE_AUTH_TOKEN_FOR_TESTING\n")
    assert "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in capfd.readouterr().err
    assert "INFO tensorstore" in path.read_text() and "google_auth_provider.cc:136] Using GOOGLE" in path.read_text()
    os.write(2, b"after\n")  # the descriptor is the terminal's again
    assert capfd.readouterr().err == "after\n"
