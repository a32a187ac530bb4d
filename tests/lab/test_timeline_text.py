"""The panel's timeline says as many pauses as it draws: occupancy.js run in Chromium on
a made-up device, without a JupyterLab (a blank page that imports the module)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ORIGIN = "http://gpushare.test"

pytestmark = pytest.mark.browser

OCCUPANCY = Path(__file__).resolve().parents[2] / "gpushare_ext" / "widgets" / "occupancy.js"


@contextlib.contextmanager
def module_page(files: dict[str, Path]) -> Iterator:
    """A blank page at :data:`ORIGIN` that may import ``files`` (URL path -> file)."""
    from playwright.sync_api import sync_playwright

    def serve(route) -> None:
        path = route.request.url.removeprefix(ORIGIN)
        if path in files:
            route.fulfill(body=files[path].read_text(), content_type="text/javascript")
        else:
            route.fulfill(body="<!doctype html><title>test</title>", content_type="text/html")

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.route(f"{ORIGIN}/**", serve)
            page.goto(f"{ORIGIN}/")
            yield page
        finally:
            browser.close()


def device_with_pauses(count: int, now: float) -> dict:
    pauses = [
        {"start": now - 50 + 10 * i, "end": now - 45 + 10 * i, "level": i % 5} for i in range(count)
    ]
    span = {"lease_id": "L1", "user": "alice", "own": True, "priority": 50, "start": now - 55}
    return {"timeline": [{**span, "end": None, "pauses": pauses}]}


@pytest.mark.parametrize("count", [1, 3, 4, 7])
def test_the_timeline_text_counts_every_pause_it_draws(count):
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing"
    now = 1_000_000.0
    with module_page({"/occupancy.js": OCCUPANCY}) as page:
        drawn, text = page.evaluate(
            """async ([device, now]) => {
                 const { renderTimeline } = await import("/occupancy.js");
                 const view = renderTimeline(device, { time: now, timeline_window_s: 600 });
                 return [view.querySelectorAll(".gpushare-timeline-pause").length,
                         view.querySelector(".gpushare-timeline-pauses").textContent];
               }""",
            [device_with_pauses(count, now), now],
        )
    assert drawn == count
    listed = text.count(" paused ")
    assert listed == min(count, 3)
    if count > listed:
        assert text.startswith(f"{count} pauses, the last {listed}: "), text
