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
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from convergedb_raw import CdbClient, eid
from servers import LOCAL, serving

import headwater
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.fields import FieldType

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
