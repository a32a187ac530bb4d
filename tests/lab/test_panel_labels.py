"""Someone's label in the GPU panel, in a real JupyterLab driven by headless Chromium.

A label is one line of up to 256 characters (``gpushare_ext/plain_text.py``), in which
control characters show as their Unicode control pictures ("␛", "␇").  In the panel your
own label must end in an ellipsis at the panel's edge (readable whole in its tooltip),
and the control pictures must be drawn as glyphs, not as the empty boxes of a font that
lacks them: no font a JupyterLab theme names has them, so occupancy.css brings its own.
Checked at 1400 px and 800 px, in the light and the dark theme, after a theme switch.
"""

from __future__ import annotations

import pytest
from test_browser import (  # noqa: F401 - the fixtures of the browser tests
    LOW,
    OUTPUT,
    SETTLE_MS,
    lab,
    page,
)
from test_dashboard import switch_theme_to

pytestmark = pytest.mark.browser

# What a cell's first line may hold: an escape sequence, a bell, then a long run without
# a space (a path, a list of arguments), 256 characters in all.
LABEL = "\x1b[2J\x07 " + ("train.py--lr=3e-4--batch=512--" * 9)[:249]
# The same as the broker sends it (plain_text): the controls as their pictures.
SHOWN = "␛[2J␇ " + LABEL[6:]


def glyphs_drawn(panel) -> dict:
    """How the label's font draws "␛" and "␇", compared on a canvas with the theme's own
    font (without the control pictures' one) and with a character no font has (U+E000,
    drawn as the font's empty box), once the page's fonts have loaded.

    The label is looked up inside the page, in the same tick as its style is read: the
    panel redraws every second, and a node fetched before may be detached by then (its
    computed style is then empty)."""
    return panel.evaluate(
        """async panel => {
          const style = getComputedStyle(panel.querySelector(".gpushare-own-label"));
          const font = `${style.fontSize} ${style.fontFamily}`;
          const themeFont = `${style.fontSize} ${style.fontFamily
            .split(",").filter(f => !f.includes("gpushare control pictures")).join(",")}`;
          await document.fonts.load(font, "\\u241b\\u2407");
          await document.fonts.ready;
          const image = (text, withFont) => {
            const canvas = document.createElement("canvas");
            canvas.width = 40; canvas.height = 40;
            const ctx = canvas.getContext("2d");
            ctx.font = withFont;
            ctx.textBaseline = "middle";
            ctx.fillText(text, 4, 20);
            return Array.from(ctx.getImageData(0, 0, 40, 40).data).join(",");
          };
          const escape = image("\\u241b", font);
          const bell = image("\\u2407", font);
          return {
            family: style.fontFamily,
            loaded: document.fonts.check(`${style.fontSize} "gpushare control pictures"`, "\\u241b"),
            escapeIsABox: escape === image("\\ue000", font),
            bellIsABox: bell === image("\\ue000", font),
            escapeAsTheThemeDrawsIt: escape === image("\\u241b", themeFont),
            escapeIsNotBell: escape !== bell,
          };
        }"""
    )


@pytest.mark.parametrize("theme", ["light", "dark"])
@pytest.mark.parametrize("width", [1400, 800])
def test_a_long_own_label_ends_in_an_ellipsis_and_its_controls_show(page, sessions, width, theme):  # noqa: F811
    from playwright.sync_api import expect

    page.set_viewport_size({"width": width, "height": 1000})
    page.locator('.jp-SideBar .lm-TabBar-tab[data-id="gpushare-panel"]').click()
    panel = page.locator("#gpushare-panel")
    expect(panel.locator(".gpushare-device")).to_have_count(1, timeout=SETTLE_MS)
    sessions().request_lease(priority=LOW, memory_bytes=10 << 30, label=LABEL)
    label = panel.locator(".gpushare-own-label")
    expect(label).to_have_count(1, timeout=SETTLE_MS)
    switch_theme_to(page, theme)
    expect(label).to_have_text(SHOWN, timeout=SETTLE_MS)

    # One pass in the page: the panel redraws every second.
    seen = panel.evaluate(
        """panel => {
          const label = panel.querySelector(".gpushare-own-label");
          const edge = panel.getBoundingClientRect();
          const box = label.getBoundingClientRect();
          const style = getComputedStyle(label);
          return {
            inside: box.left >= edge.left - 1 && box.right <= edge.right + 1,
            cut: label.scrollWidth > label.clientWidth,
            ellipsis: style.textOverflow,
            height: box.height, fontSize: style.fontSize, lineHeight: style.lineHeight,
            oneLine: box.height < 2 * parseFloat(style.fontSize),
            title: label.title,
            panelScrolls: panel.scrollWidth > panel.clientWidth + 1,
          };
        }"""
    )
    panel.screenshot(path=str(OUTPUT / f"panel-long-label-{width}-{theme}.png"))
    assert seen["inside"] and seen["cut"] and seen["oneLine"], seen
    assert seen["ellipsis"] == "ellipsis" and not seen["panelScrolls"], seen
    assert seen["title"] == SHOWN  # the whole label, as plain text

    drawn = glyphs_drawn(panel)
    assert drawn["loaded"], drawn
    assert not drawn["escapeIsABox"] and not drawn["bellIsABox"], drawn
    assert not drawn["escapeAsTheThemeDrawsIt"] and drawn["escapeIsNotBell"], drawn
    OUTPUT.mkdir(exist_ok=True)
    panel.screenshot(path=str(OUTPUT / f"panel-long-label-{width}-{theme}.png"))
