"""The GPU dashboard in a real JupyterLab, driven by headless Chromium.

The broker starts on a history file that already holds an hour (samples every 5 s, and
leases with pauses at every ladder level, one user being someone else), as a broker
that ran for an hour leaves it; the test then makes two sessions contend live.  The
dashboard must open from the command palette and from the panel's button, draw the
points and bars of that hour with a time axis, keep everything inside it at 1400 px and
800 px, in the light and the dark theme (switched to while it is open), and show other
users only as ``user-xxxx``.  Its three charts share one time axis (each time tick at the
same x), follow their cards' width through a theme switch and a side panel's toggle, zoom
together by a drag, give users colours apart and keep the hover tip inside the view.
Screenshots go to ``docs/dashboard-*.png`` (the README's tour).
"""

from __future__ import annotations

import getpass
import itertools
import math
import os
import time
from pathlib import Path

import pytest
from support import short_tempdir
from test_browser import (  # noqa: F401 - the fixtures of the browser tests
    OUTPUT,
    REPO,
    SETTLE_MS,
    contend,
    lab,
    page,
)

from gpushare_ext.broker.hands.history import HistoryStore, Holding, Sample, history_path
from gpushare_ext.broker.hands.timeline import Timeline
from gpushare_ext.broker.scheduler.core import Identity

pytestmark = pytest.mark.browser

DOCS = REPO / "docs"
OTHER = Identity(uid=os.getuid() + 4242, gid=0, pid=0, user="mallory")
ME = Identity(uid=os.getuid(), gid=os.getgid(), pid=0, user=getpass.getuser())
HOUR_S = 3600
GIB_MIB = 1024
CHARTS = ("utilization", "memory", "timeline")
# The label of one of the hour's own leases: longer than any tip is wide, with no space
# to wrap at, and control characters as plain_text shows them.
LONG_LABEL = "sweep␛[2J␇" + "-lr=3e-4" * 30


def an_hour_of_history(journal: Path, now: float, crowd: int = 0) -> None:
    """What a broker that ran this last hour would have left beside ``journal``; with
    ``crowd`` more users, each holding some memory for part of the hour."""
    store = HistoryStore(history_path(journal))
    crowded = [
        Identity(uid=os.getuid() + 5000 + i, gid=0, pid=0, user=f"student{i:02d}")
        for i in range(crowd)
    ]
    samples = []
    for step in range(HOUR_S // 5):
        at = now - HOUR_S + step * 5
        wave = 0.5 + 0.5 * math.sin(step / 40)
        memory = [Holding(ME.uid, ME.user, "leased", int(40 * GIB_MIB * wave) + GIB_MIB)]
        if step % 240 > 60:
            memory.append(Holding(OTHER.uid, OTHER.user, "leased", 30 * GIB_MIB))
        if step > 400:
            memory.append(Holding(OTHER.uid, OTHER.user, "parked", 12 * GIB_MIB))
        memory.append(Holding(-1, "", "outside", 2 * GIB_MIB))
        memory.extend(
            Holding(who.uid, who.user, "leased", (4 + i) * GIB_MIB)
            for i, who in enumerate(crowded)
            if (step + 40 * i) % 400 < 300
        )
        samples.append(
            Sample(
                at=at,
                device_index=0,
                utilization_pct=int(95 * wave),
                queued=(step // 60) % 4,
                memory=tuple(memory),
            )
        )
    store.samples_recorded(samples)
    timeline = Timeline(store=store, now=now)
    for i in range(10):
        start = now - HOUR_S + 120 + i * 330
        who = ME if i % 2 == 0 else OTHER
        lease_id = f"L{900 + i}"
        timeline.granted(lease_id, who, 50 if who is ME else 250, 0, now=start)
        label = LONG_LABEL if i == 8 else f"run {i}" if who is ME else "mallory's secret"
        timeline.labelled(lease_id, label)
        if who is ME:
            timeline.paused(lease_id, i % 5, now=start + 60)
            timeline.resumed(lease_id, now=start + 150)
        timeline.ended(lease_id, now=start + 300)
    timeline.flush()
    store.close()


@pytest.fixture
def running_broker(start_broker, request):
    """A broker on the simulated H200 that starts with the last hour already kept (a
    test may ask for ``{"crowd": N}`` more users in it)."""
    directory = short_tempdir()
    an_hour_of_history(directory / "journal.sqlite", time.time(), **getattr(request, "param", {}))
    return start_broker(directory=directory)


def open_dashboard_from_the_palette(tab):
    from playwright.sync_api import expect

    tab.keyboard.press("Control+Shift+C")
    palette = tab.locator(".lm-CommandPalette-input")
    expect(palette).to_be_visible()
    palette.fill("GPU dashboard")
    tab.keyboard.press("Enter")
    dashboard = tab.locator(".gpushare-dashboard")
    expect(dashboard).to_be_visible(timeout=SETTLE_MS)
    return dashboard


def open_dashboard_by_its_command(tab):
    from playwright.sync_api import expect

    tab.wait_for_function("() => window.jupyterapp?.commands.hasCommand('gpushare:open-dashboard')")
    tab.evaluate("() => window.jupyterapp.commands.execute('gpushare:open-dashboard')")
    dashboard = tab.locator(".gpushare-dashboard")
    expect(dashboard).to_be_visible(timeout=SETTLE_MS)
    return dashboard


def use_theme(tab, theme: str) -> None:
    """Switch JupyterLab to ``theme`` ("light" or "dark") through the command palette."""
    from playwright.sync_api import expect

    name = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}[theme]
    tab.keyboard.press("Control+Shift+C")
    tab.locator(".lm-CommandPalette-input").fill(f"Use Theme: {name}")
    tab.keyboard.press("Enter")
    light = "true" if theme == "light" else "false"
    expect(tab.locator("body")).to_have_attribute("data-jp-theme-light", light, timeout=10_000)
    # JupyterLab covers the page with its splash screen while a theme loads: until it
    # is gone, the pointer would reach it, not the dashboard.
    expect(tab.locator("#jupyterlab-splash")).to_have_count(0, timeout=10_000)


def switch_theme_to(tab, theme: str) -> None:
    """End in ``theme`` after a switch, whichever theme was in force: light is reached
    from dark, so that both are tested after a theme change."""
    if theme == "light":
        use_theme(tab, "dark")
    use_theme(tab, theme)


def drawn(dashboard, chart: str, what: str = "points") -> int:
    plot = dashboard.locator(f'[data-chart="{chart}"] .gpushare-dashboard-plot')
    return int(plot.get_attribute(f"data-{what}") or 0)


def wait_for_the_hour(dashboard, contended: bool = True) -> None:
    """Until the hour's pauses are drawn (5), and the live one of ``contend`` (1)."""
    from playwright.sync_api import expect

    plot = dashboard.locator('[data-chart="timeline"] .gpushare-dashboard-plot')
    pauses = "6" if contended else "5"
    expect(plot).to_have_attribute("data-pauses", pauses, timeout=SETTLE_MS)


def assert_the_hour_is_drawn(dashboard) -> None:
    samples = HOUR_S // 5 - 20  # the first of the hour leave it as the test runs
    assert drawn(dashboard, "utilization") >= samples
    assert drawn(dashboard, "memory") >= samples * 3
    assert drawn(dashboard, "timeline") >= 12  # ten of the hour, two live
    for chart in CHARTS:
        axes = dashboard.locator(f'[data-chart="{chart}"] .u-axis')
        assert axes.count() >= 1, f"{chart} has no axis"


def chart_boxes(dashboard) -> dict:
    """Each chart's ticks (its ``data-ticks``: "14:05@512.3 ..."), the box of its plot area
    and of its card, its canvas's width and its lanes, read in one pass (the dashboard
    redraws every 5 s, and a time tick moves with the hour)."""
    return dashboard.evaluate(
        """dash => {
          const box = node => {
            const b = node.getBoundingClientRect();
            return { x: b.x, y: b.y, width: b.width, height: b.height };
          };
          const charts = {};
          for (const figure of dash.querySelectorAll("[data-chart]")) {
            const plot = figure.querySelector(".gpushare-dashboard-plot");
            charts[figure.dataset.chart] = {
              ticks: (plot.dataset.ticks || "").split(" ").filter(Boolean).map(t => {
                const [label, x] = t.split("@");
                return [label, parseFloat(x)];
              }),
              over: box(plot.querySelector(".u-over")),
              canvas: box(plot.querySelector("canvas")),
              plot: box(plot),
              card: box(figure),
              lanes: Number(plot.dataset.lanes || 0),
              users: Number(plot.dataset.users || 0),
              points: Number(plot.dataset.points || 0),
              labelled: Number(plot.dataset.labelled || 0),
            };
          }
          const section = dash.querySelector(".gpushare-dashboard-gpu");
          return { charts, window: section.dataset.window, dashboard: box(dash) };
        }"""
    )


def assert_one_time_axis(seen: dict) -> None:
    """The three charts tick at the same times, each at the same x on the page."""
    ticks = {name: seen["charts"][name]["ticks"] for name in CHARTS}
    assert len(ticks["timeline"]) >= 2, ticks
    for name in ("utilization", "memory"):
        assert [label for label, _ in ticks[name]] == [label for label, _ in ticks["timeline"]]
        for (label, x), (_, x_timeline) in zip(ticks[name], ticks["timeline"], strict=True):
            assert abs(x - x_timeline) <= 1, f"{label}: {name} at {x}, timeline at {x_timeline}"
    overs = [seen["charts"][name]["over"] for name in CHARTS]
    assert max(o["x"] for o in overs) - min(o["x"] for o in overs) <= 1, overs
    assert max(o["width"] for o in overs) - min(o["width"] for o in overs) <= 1, overs


def assert_charts_fill_their_cards(seen: dict) -> None:
    for name in CHARTS:
        chart = seen["charts"][name]
        assert abs(chart["canvas"]["width"] - chart["plot"]["width"]) <= 1, (name, chart)
        assert chart["canvas"]["x"] + chart["canvas"]["width"] <= (
            chart["card"]["x"] + chart["card"]["width"]
        ), (name, chart)


def tick_step_s(ticks: list) -> int:
    """The time between two ticks ("00:30", "00:40"), in seconds."""

    def seconds(label: str) -> int:
        parts = [int(part) for part in label.split(":")] + [0]
        return parts[0] * 3600 + parts[1] * 60 + parts[2]

    return (seconds(ticks[1][0]) - seconds(ticks[0][0])) % 86400


def hover_lease(tab, dashboard, fraction_of_hour: float, lane: int) -> None:
    """The pointer over the lease chart, that far into the hour, in the middle of that lane."""
    seen = chart_boxes(dashboard)
    over = seen["charts"]["timeline"]["over"]
    lanes = seen["charts"]["timeline"]["lanes"]
    x = over["x"] + over["width"] * fraction_of_hour
    y = over["y"] + over["height"] * (lane + 0.5) / lanes
    tab.mouse.move(over["x"] + 5, over["y"] + 5)
    tab.mouse.move(x, y, steps=4)


def test_the_dashboard_opens_from_the_palette_and_from_the_panel(page, sessions):  # noqa: F811
    from playwright.sync_api import expect

    contend(sessions)
    dashboard = open_dashboard_from_the_palette(page)
    wait_for_the_hour(dashboard)
    assert_the_hour_is_drawn(dashboard)
    legend = dashboard.locator('[data-chart="memory"] .u-legend').inner_text()
    assert f"{ME.user} · leased" in legend and "other processes · outside leases" in legend
    if os.geteuid() == 0:  # an admin sees everyone's name (anonymising: test_history.py)
        assert "mallory · parked" in legend
    else:
        assert "user-" in legend and "mallory" not in dashboard.inner_text()

    # A band per user (yours first, on top), as tall as its lanes; hovering the hour's
    # first lease, in your band's first lane, names each fact of it.
    seen = chart_boxes(dashboard)["charts"]["timeline"]
    assert seen["users"] == 2, seen
    assert seen["over"]["height"] >= 18 * seen["lanes"], seen
    hover_lease(page, dashboard, (120 + 150) / HOUR_S, lane=0)
    tip = page.locator(".gpushare-dashboard-tip")
    expect(tip).to_be_visible(timeout=5_000)
    for fact in ("L900 run 0", "lease: L900", "label: run 0", f"user: {ME.user} (you)"):
        expect(tip).to_contain_text(fact)
    expect(tip).to_contain_text("priority: low")
    expect(tip).to_contain_text("at level 0 (gate)")

    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="GPU dashboard").locator(
        ".lm-TabBar-tabCloseIcon"
    ).click()
    expect(dashboard).to_have_count(0)
    page.locator('.jp-SideBar .lm-TabBar-tab[data-id="gpushare-panel"]').click()
    page.locator("#gpushare-panel .gpushare-dashboard-button").click()
    wait_for_the_hour(page.locator(".gpushare-dashboard"))


def assert_nothing_clipped(dashboard) -> None:
    problems = dashboard.evaluate(
        """dash => {
          const edge = dash.getBoundingClientRect();
          const found = [];
          for (const node of dash.querySelectorAll("canvas, .u-legend, figcaption, h1, h2")) {
            const box = node.getBoundingClientRect();
            if (box.width === 0) found.push(`${node.className || node.tagName}: not drawn`);
            if (box.left < edge.left - 1 || box.right > edge.right + 1)
              found.push(`${node.className || node.tagName}: ${box.left}-${box.right} outside ${edge.left}-${edge.right}`);
          }
          if (dash.scrollWidth > dash.clientWidth + 1) found.push("the dashboard scrolls sideways");
          return found;
        }"""
    )
    assert problems == [], problems


@pytest.mark.parametrize("theme", ["light", "dark"])
@pytest.mark.parametrize("width", [1400, 800])
def test_the_dashboard_keeps_everything_inside_it(page, sessions, width, theme):  # noqa: F811
    from playwright.sync_api import expect

    page.set_viewport_size({"width": width, "height": 1100})
    contend(sessions)
    dashboard = open_dashboard_by_its_command(page)
    wait_for_the_hour(dashboard)
    # The theme changes while the dashboard is open: its charts are drawn again in the
    # new colours, and must still take their cards' width, not a guess.
    switch_theme_to(page, theme)
    wait_for_the_hour(dashboard)
    assert_the_hour_is_drawn(dashboard)
    time.sleep(0.5)  # a relayout after the sidebar settles
    assert_nothing_clipped(dashboard)
    seen = chart_boxes(dashboard)
    assert_charts_fill_their_cards(seen)
    assert_one_time_axis(seen)
    if width == 1400:  # at 800 px an hour's five-minute bars are too thin for a name
        assert seen["charts"]["timeline"]["labelled"] >= 10, seen["charts"]["timeline"]
    background = dashboard.evaluate("d => getComputedStyle(d).backgroundColor")
    if theme == "dark":
        assert background not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)"), background
    expect(dashboard.locator(".gpushare-dashboard-reset")).to_be_hidden()
    OUTPUT.mkdir(exist_ok=True)
    dashboard.screenshot(path=str(DOCS / f"dashboard-{width}-{theme}.png"))


def test_the_charts_follow_their_cards_through_a_theme_switch_and_a_side_panel(page, sessions):  # noqa: F811
    from playwright.sync_api import expect

    page.set_viewport_size({"width": 800, "height": 1100})
    dashboard = open_dashboard_by_its_command(page)
    expect(dashboard.locator('[data-chart="timeline"] canvas')).to_have_count(1, timeout=SETTLE_MS)
    switch_theme_to(page, "dark")
    time.sleep(0.5)
    narrow = chart_boxes(dashboard)
    assert_charts_fill_their_cards(narrow)
    assert_one_time_axis(narrow)

    # The file browser's side panel closes: the dashboard widens, and so do its charts,
    # without the window being resized.
    sidebar_tab = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    expect(sidebar_tab).to_have_count(1)
    sidebar_tab.click()
    page.wait_for_function(
        """width => document.querySelector(".gpushare-dashboard").getBoundingClientRect().width
             > width + 100""",
        arg=narrow["dashboard"]["width"],
    )
    time.sleep(0.5)
    wide = chart_boxes(dashboard)
    assert (
        wide["charts"]["timeline"]["canvas"]["width"]
        > narrow["charts"]["timeline"]["canvas"]["width"] + 100
    ), (narrow, wide)
    assert_charts_fill_their_cards(wide)
    assert_one_time_axis(wide)

    # And it opens again: back to the narrow cards.
    page.locator('.jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id="filebrowser"]').click()
    page.wait_for_function(
        """width => document.querySelector(".gpushare-dashboard").getBoundingClientRect().width
             < width - 100""",
        arg=wide["dashboard"]["width"],
    )
    time.sleep(0.5)
    assert_charts_fill_their_cards(chart_boxes(dashboard))


@pytest.mark.parametrize("theme", ["light", "dark"])
@pytest.mark.parametrize("width", [1400, 800])
def test_a_drag_zooms_all_three_charts_and_reset_brings_the_hour_back(
    page,  # noqa: F811
    sessions,
    width,
    theme,
):
    from playwright.sync_api import expect

    page.set_viewport_size({"width": width, "height": 1100})
    contend(sessions)
    dashboard = open_dashboard_by_its_command(page)
    wait_for_the_hour(dashboard)
    switch_theme_to(page, theme)
    wait_for_the_hour(dashboard)
    hour = chart_boxes(dashboard)
    assert hour["charts"]["timeline"]["users"] == 2

    # Drag across the lease chart over the hour's first twelve minutes: the first two
    # leases (one yours, one mallory's, each in its own band).
    over = hour["charts"]["timeline"]["over"]
    y = over["y"] + over["height"] / 2
    page.mouse.move(over["x"] + over["width"] * 60 / HOUR_S, y)
    page.mouse.down()
    page.mouse.move(over["x"] + over["width"] * 720 / HOUR_S, y, steps=8)
    page.mouse.up()
    reset = dashboard.locator(".gpushare-dashboard-reset")
    expect(reset).to_be_visible(timeout=5_000)
    zoomed = chart_boxes(dashboard)
    start, end = (float(t) for t in zoomed["window"].split("-"))
    assert 600 <= end - start <= 720, zoomed["window"]
    assert_one_time_axis(zoomed)  # the other two charts zoomed with it
    ticks = zoomed["charts"]["timeline"]["ticks"]
    assert len(ticks) >= 2 and tick_step_s(ticks) < tick_step_s(hour["charts"]["timeline"]["ticks"])
    timeline = zoomed["charts"]["timeline"]
    # Only the leases in view: fewer bars, no lane for the live ones, each bar named.
    assert timeline["points"] == 2, timeline
    assert timeline["lanes"] < hour["charts"]["timeline"]["lanes"], (timeline, hour)
    assert timeline["labelled"] == timeline["points"], timeline
    assert timeline["over"]["height"] < hour["charts"]["timeline"]["over"]["height"]
    # The zoom holds while the dashboard refreshes (every 5 s).
    time.sleep(6)
    assert chart_boxes(dashboard)["window"] == zoomed["window"]
    OUTPUT.mkdir(exist_ok=True)
    dashboard.screenshot(path=str(OUTPUT / f"dashboard-zoomed-{width}-{theme}.png"))

    reset.click()
    expect(reset).to_be_hidden()
    back = chart_boxes(dashboard)
    start, end = (float(t) for t in back["window"].split("-"))
    assert end - start == pytest.approx(HOUR_S, abs=1)
    assert back["charts"]["timeline"]["points"] >= 12
    assert_one_time_axis(back)

    # A double-click on a chart is a reset too.
    page.mouse.move(over["x"] + over["width"] * 0.2, y)
    page.mouse.down()
    page.mouse.move(over["x"] + over["width"] * 0.4, y, steps=8)
    page.mouse.up()
    expect(reset).to_be_visible(timeout=5_000)
    page.mouse.dblclick(over["x"] + over["width"] * 0.5, y)
    expect(reset).to_be_hidden(timeout=5_000)


def test_the_cursor_of_one_chart_reads_the_same_time_in_the_others(page, sessions):  # noqa: F811
    from playwright.sync_api import expect

    dashboard = open_dashboard_by_its_command(page)
    wait_for_the_hour(dashboard, contended=False)
    seen = chart_boxes(dashboard)
    label, x = seen["charts"]["timeline"]["ticks"][1]
    over = seen["charts"]["timeline"]["over"]
    page.mouse.move(x, over["y"] + over["height"] - 2)
    # The utilization chart's legend reads the time of its sample under the cursor.
    legend = dashboard.locator('[data-chart="utilization"] .u-legend .u-series').first
    expect(legend).not_to_contain_text("--", timeout=5_000)
    shown = legend.locator(".u-value").inner_text()  # "00:30:02": a sample every 5 s
    hours, minutes, seconds = (int(part) for part in shown.split(":"))
    tick_hours, tick_minutes = (int(part) for part in label.split(":"))
    off = (hours * 3600 + minutes * 60 + seconds) - (tick_hours * 3600 + tick_minutes * 60)
    # Within half a sample (5 s) and a pixel or two of the pointer's rounding; the charts
    # as they were, 27 px apart, read two minutes off.
    slack = 2.5 + 2 * HOUR_S / over["width"]
    assert abs((off + 43200) % 86400 - 43200) <= slack, (label, shown, slack)


# ---------------------------------------------------------------- colours apart


def _lab(rgb: tuple[int, int, int]) -> tuple[float, float, float]:
    linear = [
        c / 255 / 12.92 if c / 255 <= 0.04045 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb
    ]
    r, g, b = linear
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def colour_difference(one: tuple[int, int, int], other: tuple[int, int, int]) -> float:
    """CIEDE2000 between two sRGB colours: about 2 is just noticeable; beyond 10, two
    colours one tells apart at a glance."""
    return lab_difference(_lab(one), _lab(other))


def lab_difference(one: tuple[float, float, float], other: tuple[float, float, float]) -> float:
    """CIEDE2000 between two CIELAB colours (Sharma, Wu and Dalal's formulation)."""
    (l1, a1, b1), (l2, a2, b2) = one, other
    c_mean = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(c_mean**7 / (c_mean**7 + 25**7)))
    a1, a2 = a1 * (1 + g), a2 * (1 + g)
    c1, c2 = math.hypot(a1, b1), math.hypot(a2, b2)
    h1, h2 = math.degrees(math.atan2(b1, a1)) % 360, math.degrees(math.atan2(b2, a2)) % 360
    dh = 0.0 if c1 * c2 == 0 else (h2 - h1 + 180) % 360 - 180
    d_big_h = 2 * math.sqrt(c1 * c2) * math.sin(math.radians(dh / 2))
    l_mean, c_mean = (l1 + l2) / 2, (c1 + c2) / 2
    if c1 * c2 == 0:
        h_mean = h1 + h2
    elif abs(h1 - h2) <= 180:
        h_mean = (h1 + h2) / 2
    else:
        h_mean = (h1 + h2 + 360) / 2 if h1 + h2 < 360 else (h1 + h2 - 360) / 2
    t = (
        1
        - 0.17 * math.cos(math.radians(h_mean - 30))
        + 0.24 * math.cos(math.radians(2 * h_mean))
        + 0.32 * math.cos(math.radians(3 * h_mean + 6))
        - 0.20 * math.cos(math.radians(4 * h_mean - 63))
    )
    s_l = 1 + 0.015 * (l_mean - 50) ** 2 / math.sqrt(20 + (l_mean - 50) ** 2)
    s_c, s_h = 1 + 0.045 * c_mean, 1 + 0.015 * c_mean * t
    r_t = (
        -2
        * math.sqrt(c_mean**7 / (c_mean**7 + 25**7))
        * math.sin(math.radians(60 * math.exp(-(((h_mean - 275) / 25) ** 2))))
    )
    terms = ((l2 - l1) / s_l, (c2 - c1) / s_c, d_big_h / s_h)
    return math.sqrt(sum(term**2 for term in terms) + r_t * terms[1] * terms[2])


@pytest.mark.parametrize(
    ("one", "other", "expected"),
    [  # pairs 1, 7, 17 and 18 of Sharma, Wu and Dalal's CIEDE2000 test data (2005)
        ((50.0, 2.6772, -79.7751), (50.0, 0.0, -82.7485), 2.0425),
        ((50.0, 0.0, 0.0), (50.0, -1.0, 2.0), 2.3669),
        ((50.0, 2.5, 0.0), (73.0, 25.0, -18.0), 27.1492),
        ((50.0, 2.5, 0.0), (61.0, -5.0, 29.0), 22.8977),
    ],
)
def test_the_colour_difference_is_ciede2000(one, other, expected):
    assert lab_difference(one, other) == pytest.approx(expected, abs=1e-4)
    assert colour_difference((25, 118, 210), (25, 118, 210)) == 0


def rgb_of(css: str) -> tuple[int, int, int]:
    parts = css[css.index("(") + 1 : css.index(")")].split(",")
    return int(float(parts[0])), int(float(parts[1])), int(float(parts[2]))


@pytest.mark.parametrize("running_broker", [{"crowd": 7}], indirect=True)
@pytest.mark.parametrize("theme", ["light", "dark"])
@pytest.mark.parametrize("width", [1400, 800])
def test_users_get_colours_apart_in_both_themes(page, sessions, width, theme):  # noqa: F811
    page.set_viewport_size({"width": width, "height": 1100})
    dashboard = open_dashboard_by_its_command(page)
    wait_for_the_hour(dashboard, contended=False)
    switch_theme_to(page, theme)
    wait_for_the_hour(dashboard, contended=False)
    markers = dashboard.evaluate(
        """dash => [...dash.querySelectorAll('[data-chart="memory"] .u-legend .u-series')]
             .slice(1)
             .map(row => [row.querySelector(".u-label").textContent,
                          getComputedStyle(row.querySelector(".u-marker")).borderTopColor])"""
    )
    colours: dict[str, tuple[int, int, int]] = {}
    for label, colour in markers:
        user = label.split(" · ")[0]
        assert colours.setdefault(user, rgb_of(colour)) == rgb_of(colour), (user, markers)
    # You, mallory, seven students and "other processes": ten, each in a colour of its own.
    assert len(colours) == 10, colours
    for (one, a), (other, b) in itertools.combinations(colours.items(), 2):
        assert colour_difference(a, b) >= 15, (one, a, other, b, colour_difference(a, b))
    card = rgb_of(
        dashboard.locator(".gpushare-dashboard-chart").first.evaluate(
            "card => getComputedStyle(card).backgroundColor"
        )
    )
    for user, rgb in colours.items():
        assert colour_difference(rgb, card) >= 30, (user, rgb, card)
    OUTPUT.mkdir(exist_ok=True)
    dashboard.screenshot(path=str(OUTPUT / f"dashboard-crowd-{width}-{theme}.png"))


# ---------------------------------------------------------------- the hover tip


@pytest.mark.parametrize("theme", ["light", "dark"])
@pytest.mark.parametrize("width", [1400, 800])
def test_the_tip_stays_inside_the_dashboard_and_wraps_long_labels(page, sessions, width, theme):  # noqa: F811
    from playwright.sync_api import expect

    # A short window: the lease chart ends at the dashboard's bottom edge.
    page.set_viewport_size({"width": width, "height": 700})
    dashboard = open_dashboard_by_its_command(page)
    wait_for_the_hour(dashboard, contended=False)
    switch_theme_to(page, theme)
    wait_for_the_hour(dashboard, contended=False)
    dashboard.evaluate("d => { d.scrollTop = d.scrollHeight; }")
    seen = chart_boxes(dashboard)
    timeline = seen["charts"]["timeline"]
    assert (
        timeline["over"]["y"] + timeline["over"]["height"]
        > seen["dashboard"]["y"] + 0.6 * (seen["dashboard"]["height"])
    ), "the lease chart is not near the bottom edge"

    # L908, yours, with the long label: in your band (the first), near the hour's end.
    tip = page.locator(".gpushare-dashboard-tip")
    middle_of_l908 = (120 + 8 * 330 + 150) / HOUR_S
    hover_lease(page, dashboard, middle_of_l908, lane=0)
    expect(tip).to_be_visible(timeout=5_000)
    expect(tip).to_contain_text("label: sweep␛[2J␇-lr=3e-4")
    # The lowest lane, mallory's L909, right at the bottom edge.
    for fraction, lane in ((middle_of_l908, 0), ((120 + 9 * 330 + 150) / HOUR_S, -1)):
        lanes = chart_boxes(dashboard)["charts"]["timeline"]["lanes"]
        hover_lease(page, dashboard, fraction, lane=lane % lanes)
        expect(tip).to_be_visible(timeout=5_000)
        inside = dashboard.evaluate(
            """dash => {
              const tip = document.querySelector(".gpushare-dashboard-tip");
              const edge = dash.getBoundingClientRect();
              const box = tip.getBoundingClientRect();
              const lines = [...tip.children].map(line => line.getBoundingClientRect());
              return {
                inside: box.left >= edge.left && box.right <= edge.right
                  && box.top >= edge.top && box.bottom <= edge.bottom,
                overflows: tip.scrollWidth > tip.clientWidth + 1,
                linesInside: lines.every(l => l.right <= box.right + 1),
                box: [box.left, box.top, box.right, box.bottom],
                edge: [edge.left, edge.top, edge.right, edge.bottom],
              };
            }"""
        )
        assert inside["inside"] and not inside["overflows"] and inside["linesInside"], inside
        OUTPUT.mkdir(exist_ok=True)
        dashboard.screenshot(path=str(OUTPUT / f"dashboard-tip-{width}-{theme}-lane-{lane}.png"))
