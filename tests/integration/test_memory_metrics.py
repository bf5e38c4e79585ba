"""The memory budget seen from outside a real server: /metrics reports its RssAnon,
RssFile and budget, and a server whose limits cannot fit memory_mib says so in one
warning line at start, and serves all the same."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

from servers import LOCAL, Server

import headwater
from headwater.server.memory import process_memory


def metrics(server: Server) -> dict[str, float]:
    url = f"http://127.0.0.1:{server.ports['http']}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith(("headwater_process_rss", "headwater_memory_budget"))
    }


def test_metrics_report_resident_memory_and_the_budget(
    make_server: Callable[..., Server],
) -> None:
    server = make_server(config="[limits]\nmemory_mib = 2048\n", listen={"http": LOCAL})
    seen = metrics(server)
    memory = process_memory(server.pid)
    assert memory is not None
    assert seen["headwater_memory_budget_bytes"] == 2048 * 1024 * 1024
    # The scrape's own reading and ours, a moment apart: the same process, the same order.
    assert 0.5 < seen["headwater_process_rss_anon_bytes"] / memory.rss_anon < 2
    assert seen["headwater_process_rss_file_bytes"] > 0
    assert "more than limits.memory_mib" not in server.log_text()


def test_limits_that_cannot_fit_the_budget_are_named_at_start(
    make_server: Callable[..., Server],
) -> None:
    server = make_server(config="[limits]\nmemory_mib = 200\nsql_memory_mib = 512\n")
    warnings = [line for line in server.log_text().splitlines() if "limits.memory_mib" in line]
    assert len(warnings) == 1, warnings
    assert "WARNING" in warnings[0]
    assert "more than limits.memory_mib = 200" in warnings[0]
    assert "SQL (sql_memory_mib x sql_concurrency) 1024 MiB" in warnings[0]
    with headwater.connect(server.address) as hw:  # a warning, not a refusal
        hw.create_stream("s")
        assert hw.append("s", [b"x"]).first_offset == 0
