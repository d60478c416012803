"""The load generator's ``until``: a load ends when another thread says so, every request sent still counted."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serving_harness.loadgen import closed_loop, open_loop, run


class _Answers(BaseHTTPRequestHandler):
    """Answers every POST 200 after reading its body; counts what it answered.

    Counted before the answer is written: counted after it, the client could
    read its last answer and the test compare the counts before this thread
    had counted it (248 samples against 247 answers, CI 2026-11-30).
    """

    answered = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        with _Answers.lock:
            _Answers.answered += 1
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    _Answers.answered = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/predictions/m"
    server.shutdown()
    server.server_close()


def stop_after(seconds: float) -> threading.Event:
    until = threading.Event()
    threading.Timer(seconds, until.set).start()
    return until


@pytest.mark.parametrize("loop", ["closed", "open"])
def test_a_load_set_to_run_a_minute_ends_soon_after_until_is_set_with_every_request_counted(url, loop):
    until = stop_after(0.5)
    if loop == "closed":
        result = run(closed_loop(url, lambda i: b"x", 4, 60.0, until=until))
    else:
        result = run(open_loop(url, lambda i: b"x", [(60.0, 40.0)], seed=3, until=until))
    assert result.wall_s < 30.0  # ended by ``until``, not by its minute
    assert len(result.samples) > 0 and result.failed == 0
    assert len(result.samples) == _Answers.answered  # sent after the stop: none; in flight then: awaited


def test_until_unset_leaves_the_duration_in_charge(url):
    result = run(closed_loop(url, lambda i: b"x", 2, 0.3, until=threading.Event()))
    assert 0.3 <= result.wall_s < 30.0 and result.failed == 0 and len(result.samples) == _Answers.answered
