"""``start_dev_server`` against the real ``temporal`` binary: a port race is retried, other failures say why.

A dev server that finds a port taken exits at once with "address already in use"; the
ports it picks for itself can be taken between its pick and its bind (the CI failure of
2026-11-30: "the Temporal dev server exited", and nothing more). Here the UI port is the
one held, because that is the port a test can hold on purpose.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from fakes.ports import free_ports

from koi.config import Settings
from workers.dev import DEV_SERVER_ATTEMPTS, _log_tail, port_open, start_dev_server

pytestmark = [pytest.mark.temporal, pytest.mark.slow]


def _settings(tmp_path, port: int, ui: int) -> Settings:
    return Settings(data_dir=tmp_path / "data", temporal_address=f"localhost:{port}", temporal_ui_port=ui)


def _hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_port_held_for_good_fails_with_the_servers_own_words(tmp_path):
    port, ui = free_ports(2)
    with _hold(ui), pytest.raises(RuntimeError) as err:
        start_dev_server(_settings(tmp_path, port, ui), wait_s=30)
    msg = str(err.value)
    assert "the Temporal dev server exited" in msg
    assert f"can't set UI port {ui}" in msg and "address already in use" in msg
    log = (tmp_path / "data" / "logs" / "temporal.log").read_text()
    assert log.count(f"can't set UI port {ui}") == DEV_SERVER_ATTEMPTS  # it did retry, then gave up
    assert not port_open("127.0.0.1", port)


def test_a_port_freed_after_the_first_try_starts_on_the_second(tmp_path):
    port, ui = free_ports(2)
    s = _settings(tmp_path, port, ui)
    log = tmp_path / "data" / "logs" / "temporal.log"
    holder = _hold(ui)

    def release_after_first_failure() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if log.exists() and "address already in use" in log.read_text():
                break
            time.sleep(0.02)
        holder.close()

    t = threading.Thread(target=release_after_first_failure)
    t.start()
    proc = start_dev_server(s, wait_s=60)
    try:
        t.join()
        assert port_open("127.0.0.1", port)
        assert log.read_text().count("address already in use") == 1
    finally:
        proc.stop()
    assert not port_open("127.0.0.1", port)


def test_log_tail_reads_only_what_this_start_wrote(tmp_path):
    log = tmp_path / "temporal.log"
    log.write_text("old run\nold error\n")
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write("line 1\n" + "".join(f"line {i}\n" for i in range(2, 12)))
    tail = _log_tail(log, offset, lines=3)
    assert tail == "line 9\nline 10\nline 11"
    assert _log_tail(tmp_path / "missing.log", 0) == ""
