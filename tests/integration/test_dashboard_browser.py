"""The dashboard in a real headless Chromium (Debian's /usr/bin/chromium, driven by
playwright) against a real ``headwater serve``: the page loads without console errors,
lists a stream created over the Kimberlite protocol, its live tail shows an event
appended after the page opened (through the Kiwi WebSocket), and a kind's live table
follows an entity asserted over ConvergeDB. A screenshot is kept in the test's tmp dir
(and in $HEADWATER_SCREENSHOT_DIR when set)."""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from convergedb_raw import CdbClient, eid
from servers import LOCAL, serving

import headwater
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.fields import FieldType
from waiting import wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
LISTEN = {"http": LOCAL, "convergedb": LOCAL}
FIELDS = [("symbol", FieldType.STRING), ("price", FieldType.F64), ("volume", FieldType.I64)]
WAIT_MS = 20_000

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    for server in serving(tmp_path_factory.mktemp("dashboard_browser"), listen=LISTEN):
        yield server.ports


@pytest.fixture
def page(server: dict[str, int]) -> Iterator[tuple[Any, list[str]]]:
    from playwright import sync_api  # a test dependency: missing it is an error, not a skip

    problems: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            tab.set_default_timeout(WAIT_MS)
            tab.on(
                "console",
                lambda msg: (
                    problems.append(f"console {msg.type}: {msg.text}")
                    if msg.type in ("error", "warning")
                    else None
                ),
            )
            tab.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            tab.on(
                "requestfailed",
                lambda req: problems.append(f"request failed: {req.url} {req.failure}"),
            )
            yield tab, problems
        finally:
            browser.close()


def keep_screenshot(tab: Any, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    tab.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000  # a rendered page, not a blank one
    extra = os.environ.get("HEADWATER_SCREENSHOT_DIR")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(extra) / path.name)


def test_dashboard_lists_and_follows_streams_and_kinds(
    server: dict[str, int], page: tuple[Any, list[str]], tmp_path: Path
) -> None:
    tab, problems = page
    stream = f"trades_{uuid.uuid4().hex[:8]}"
    with (
        headwater.connect(f"127.0.0.1:{server['kimberlite']}") as client,
        CdbClient(server["convergedb"], name="quotes-feed") as writer,
    ):
        client.create_stream(stream)
        client.append(stream, [b'{"sym":"ACME","px":10}', b'{"sym":"INIT","px":11}'])
        kind = writer.create_kind("quotes", [(n, int(t)) for n, t in FIELDS])
        for i, symbol in enumerate(("ACME", "GLOBEX", "INITECH")):
            writer.call(m.Assert.of(FIELDS, kind.kind_id, eid(i), [symbol, 10.0 + i, 100 * i]))

        tab.goto(f"http://127.0.0.1:{server['http']}/")
        assert tab.title() == "headwater dashboard"
        row = tab.locator(f'#streams-table tbody tr[data-name="{stream}"]')
        row.wait_for()
        assert row.locator("td").nth(1).inner_text() == "2"  # events
        tab.locator('#kinds-table tbody tr[data-name="quotes"]').wait_for()
        tab.locator("#ws-status[data-state='ok']").wait_for()
        tab.locator("#sources-table tbody tr", has_text="quotes-feed").wait_for()

        # Live tail: the backfilled events first, then one appended after subscribing.
        row.click()
        tab.locator("#live-panel[data-subscribed='true'][data-loaded='true']").wait_for()
        tail = tab.locator("#tail-table tbody tr")
        assert tail.count() == 2
        marker = f"live-{uuid.uuid4().hex}"
        (offset, _count) = client.append(stream, [json.dumps({"marker": marker}).encode()])
        fresh = tab.locator(f'#tail-table tbody tr[data-offset="{offset}"]')
        fresh.wait_for()
        assert marker in fresh.inner_text()
        assert tail.count() == 3
        tab.wait_for_timeout(300)  # let the next poll draw the rate and the chart
        keep_screenshot(tab, tmp_path, "dashboard-stream")

        # Live table of a kind: the three entities, then a change and a new one.
        tab.locator('#kinds-table tbody tr[data-name="quotes"]').click()
        tab.locator("#live-panel[data-subscribed='true'][data-loaded='true']").wait_for()
        entities = tab.locator("#kind-table tbody tr")
        assert entities.count() == 3
        headers = tab.locator("#kind-table thead th").all_inner_texts()
        assert headers == ["Entity", "Version", "symbol", "price", "volume"]
        writer.call(m.Assert.of(FIELDS, kind.kind_id, eid(1), ["GLOBEX", 99.5, 7]))
        writer.call(m.Assert.of(FIELDS, kind.kind_id, eid(7), ["HOOLI", 1.25, 3]))
        changed = tab.locator(f'#kind-table tbody tr[data-entity="{eid(1).hex()}"]')
        tab.wait_for_function(
            "id => (document.querySelector(`#kind-table tr[data-entity='${id}']`) || {})"
            ".textContent?.includes('99.5')",
            arg=eid(1).hex(),
        )
        assert "GLOBEX" in changed.inner_text()
        tab.locator(f'#kind-table tbody tr[data-entity="{eid(7).hex()}"]').wait_for()
        assert (
            "HOOLI"
            in tab.locator(f'#kind-table tbody tr[data-entity="{eid(7).hex()}"]').inner_text()
        )
        keep_screenshot(tab, tmp_path, "dashboard-kind")
        # A retraction strikes the row through, then takes it away.
        writer.call(m.Retract(kind.kind_id, eid(2)))
        gone = tab.locator(f'#kind-table tbody tr[data-entity="{eid(2).hex()}"]')
        tab.locator(f'#kind-table tbody tr.gone[data-entity="{eid(2).hex()}"]').wait_for()
        gone.wait_for(state="detached")
        assert entities.count() == 3

    assert problems == []


def http_json(server: dict[str, int], path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server['http']}{path}", timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def visible_offsets(tab: Any) -> list[int]:
    rows = tab.locator("#tail-table tbody tr:visible")
    return [int(offset) for offset in rows.evaluate_all("rows => rows.map(r => r.dataset.offset)")]


def test_dashboard_actions(
    server: dict[str, int], page: tuple[Any, list[str]], tmp_path: Path
) -> None:
    """History after a reload, the SQL console, stream create (with settings), produce,
    the tail's filter and dates, stream delete, a group's lag and its offset reset, and
    the connections card shown whole."""
    tab, problems = page
    suffix = uuid.uuid4().hex[:8]
    source, created = f"clicks_{suffix}", f"made_{suffix}"
    with (
        headwater.connect(f"127.0.0.1:{server['kimberlite']}") as client,
        CdbClient(server["convergedb"], name="card-check"),
    ):
        client.create_stream(source)
        client.append(source, [json.dumps({"n": i}).encode() for i in range(40)])
        with client.subscribe(source, 0, credits=4, group="billing") as sub:
            events = iter(sub)
            for _ in range(20):
                next(events)
        # Idle (the server has seen the subscription end), so the page can reset it.
        wait_until(
            lambda: (
                not [
                    g
                    for g in http_json(server, "/api/consumer-groups")[1]["groups"]
                    if g["stream"] == source and g["active"]
                ]
            ),
            message="the group never went idle",
        )
        tab.goto(f"http://127.0.0.1:{server['http']}/")
        tab.locator("#chart-events[data-history-points]").wait_for(state="attached")

        # History: appends and reads after the page loaded are in the server's hour after
        # a reload.
        client.append(source, [b"{}"] * 10)
        assert len(http_json(server, f"/api/streams/{source}/events?limit=5")[1]["events"]) == 5
        tab.reload()
        tab.wait_for_function(
            "() => Number(document.querySelector('#chart-events').dataset.historyPeak) > 0"
            " && Number(document.querySelector('#chart-reads').dataset.peak) > 0"
        )

        # The connections card lists every listener with a connection, none cut off.
        tab.wait_for_function(
            "() => ['convergedb', 'http', 'kimberlite', 'kiwi']"
            ".every(p => document.getElementById('card-conns-sub').textContent.includes(p))"
        )
        assert tab.evaluate(
            "() => { const e = document.getElementById('card-conns-sub');"
            " return e.scrollWidth <= e.clientWidth && e.scrollHeight <= e.clientHeight; }"
        )

        # A group's lag, then its offset reset to the start and to an offset typed in.
        group_row = tab.locator(
            f'#groups-table tbody tr[data-stream="{source}"][data-group="billing"]'
        )
        group_row.wait_for()
        _, groups = http_json(server, "/api/consumer-groups")
        (billing,) = [g for g in groups["groups"] if g["stream"] == source]
        assert group_row.locator("td").nth(4).inner_text() == str(50 - billing["committed_offset"])
        group_row.locator("button[data-action='reset']").click()
        tab.select_option("#group-reset-to", "earliest")
        tab.click("#group-reset-apply")
        tab.locator("#group-reset-status", has_text="now at offset 0 (lag 50)").wait_for()
        tab.wait_for_function(
            "sel => document.querySelector(sel).cells[4].textContent === '50'",
            arg=f'#groups-table tbody tr[data-stream="{source}"][data-group="billing"]',
        )
        group_row.locator("button[data-action='reset']").click()
        tab.select_option("#group-reset-to", "offset")
        tab.fill("#group-reset-offset", "999")
        tab.click("#group-reset-apply")
        tab.locator("#group-reset-error", has_text="InvalidOffset").wait_for()
        tab.fill("#group-reset-offset", "45")
        tab.click("#group-reset-apply")
        tab.locator("#group-reset-status", has_text="now at offset 45 (lag 5)").wait_for()
        _, groups = http_json(server, "/api/consumer-groups")
        assert [g["committed_offset"] for g in groups["groups"] if g["stream"] == source] == [45]

        # SQL: Run on the empty box runs the example it shows, as it is (it was invalid
        # SQL once: a table that did not exist and DuckDB's reserved word offset unquoted).
        assert tab.input_value("#sql-text") == ""
        tab.click("#sql-run")
        tab.locator("#sql-info", has_text=" ms").wait_for()
        assert tab.locator("#sql-error").is_hidden()
        example = tab.input_value("#sql-text")
        assert example.startswith("SELECT * FROM ") and 'ORDER BY "offset" DESC' in example
        assert "offset" in tab.locator("#sql-table thead th").all_inner_texts()
        # A result table, then an error shown as such.
        tab.fill(
            "#sql-text", f"SELECT count(*) AS events, 'x' AS label, NULL AS nothing FROM {source}"
        )
        tab.click("#sql-run")
        tab.locator("#sql-info", has_text="1 row").wait_for()
        assert tab.locator("#sql-table thead th").all_inner_texts() == [
            "events",
            "label",
            "nothing",
        ]
        assert tab.locator("#sql-table tbody tr").all_inner_texts() == ["50\tx\tNULL"]
        tab.fill("#sql-text", "SELEC 1")
        tab.locator("#sql-text").press("Control+Enter")
        tab.locator("#sql-error", has_text="QueryParseError").wait_for()
        assert tab.locator("#sql-table").is_hidden()

        # Create a stream with settings: it opens in the live view with them.
        tab.click("#stream-new")
        tab.fill("#stream-name", created)
        tab.select_option("#stream-retention", "86400000")
        tab.select_option("#stream-sync", "none")
        tab.select_option("#stream-cleanup", "compact")
        tab.click("#stream-create")
        tab.locator(f'#streams-table tbody tr[data-name="{created}"]').wait_for()
        tab.locator("#live-panel[data-subscribed='true'][data-loaded='true']").wait_for()
        tab.locator("#stream-settings", has_text="retention 1 d").wait_for()
        assert "sync none" in tab.inner_text("#stream-settings")
        assert "cleanup compact" in tab.inner_text("#stream-settings")
        status, described = http_json(server, f"/api/streams/{created}")
        assert status == 200
        # The settings entered are stored; the others (timestamp_type, ...) keep their
        # defaults, which the API reports too.
        entered = {"retention_ms": 86_400_000, "sync": "none", "cleanup_policy": "compact"}
        assert {key: described["settings"].get(key) for key in entered} == entered

        # Produce: JSON stored compact, other text as typed; each shows in the tail with
        # its date and time.
        for offset, typed in enumerate(('{"user": {"id": 42}, "msg": "hi"}', "plain words")):
            tab.fill("#produce-value", typed)
            tab.click("#produce-send")
            tab.locator(f'#tail-table tbody tr[data-offset="{offset}"]').wait_for()
        _, stored = http_json(server, f"/api/streams/{created}/events")
        assert [e["value"] for e in stored["events"]] == [
            '{"user":{"id":42},"msg":"hi"}',
            "plain words",
        ]
        first = tab.locator('#tail-table tbody tr[data-offset="0"] td')
        when = datetime.fromtimestamp(stored["events"][0]["timestamp_ms"] / 1000, UTC)
        assert (
            first.nth(1).inner_text()
            == when.strftime("%Y-%m-%d %H:%M:%S.") + f"{when.microsecond // 1000:03d}"
        )

        # Filter the tail: by a JSON field, by text, and new rows follow the filter.
        tab.fill("#tail-filter", "user.id=42")
        tab.locator("#tail-filter-info", has_text="1 of 2 rows match").wait_for()
        assert visible_offsets(tab) == [0]
        for offset, typed in ((2, '{"user": {"id": 7}}'), (3, '{"user": {"id": 42}, "b": 1}')):
            tab.fill("#produce-value", typed)
            tab.click("#produce-send")
            tab.locator(f'#tail-table tbody tr[data-offset="{offset}"]').wait_for(state="attached")
        assert visible_offsets(tab) == [3, 0]  # offset 2 (id 7) arrived, hidden
        tab.fill("#tail-filter", "PLAIN")
        assert visible_offsets(tab) == [1]
        tab.fill("#tail-filter", "")
        assert visible_offsets(tab) == [3, 2, 1, 0]

        # Delete, after the confirmation.
        asked: list[str] = []
        tab.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
        tab.click("#stream-delete")
        tab.locator(f'#streams-table tbody tr[data-name="{created}"]').wait_for(state="detached")
        assert asked and created in asked[0]
        assert http_json(server, f"/api/streams/{created}")[0] == 404
        # Back to the empty live view once the page has the DELETE's answer (a poll
        # running meanwhile may drop the row first: CI once checked in between).
        tab.locator("#live-empty").wait_for(state="visible")
        keep_screenshot(tab, tmp_path, "dashboard-actions")

    # The browser reports each refused request (the bad SQL and offset: 400) as a console
    # error; anything else is a problem.
    refused = "Failed to load resource: the server responded with a status of 400"
    assert [p for p in problems if refused not in p] == []
