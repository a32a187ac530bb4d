"""Write the control pictures' font into gpushare_ext/widgets/occupancy.css.

Why: gpushare shows control characters in someone's label as their Unicode control
pictures ("␛" for escape, "␇" for bell: gpushare_ext/plain_text.py), and no font that
a JupyterLab theme names (system-ui, Helvetica, Arial, DejaVu Sans, Liberation Sans)
draws them: they showed as empty boxes.  So occupancy.css carries its own small font for
exactly U+2400-U+2426, a subset of Noto Sans Symbols 2 (SIL Open Font License 1.1, its
copyright and licence kept in the font's name table and quoted in the CSS), as a data
URL: the notebook widget and the JupyterLab panel load the same CSS, with nothing else to
fetch.  `unicode-range` keeps the browser from using it for anything else.

Run it again only to change the font:

    npm pack @fontsource/noto-sans-symbols-2@5.3.0
    tar xzf fontsource-noto-sans-symbols-2-5.3.0.tgz
    .venv/bin/python labextension/scripts/control_pictures_font.py \\
        package/files/noto-sans-symbols-2-symbols-400-normal.woff

It needs fontTools (``pip install fonttools``).
"""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

from fontTools import subset
from fontTools.ttLib import TTFont

CSS = Path(__file__).resolve().parents[2] / "gpushare_ext" / "widgets" / "occupancy.css"
BEGIN = "/* control pictures' font: begin (labextension/scripts/control_pictures_font.py) */"
END = "/* control pictures' font: end */"
FAMILY = "gpushare control pictures"
UNICODES = range(0x2400, 0x2427)  # the Control Pictures block: NUL's picture to ⑀'s


def subset_woff(source: Path) -> bytes:
    options = subset.Options()
    options.flavor = "woff"
    options.name_IDs = ["*"]  # the copyright and the licence travel with the glyphs
    options.layout_features = []
    font = TTFont(source, recalcTimestamp=False)  # the same font gives the same CSS
    subsetter = subset.Subsetter(options)
    subsetter.populate(unicodes=UNICODES)
    subsetter.subset(font)
    missing = [hex(c) for c in UNICODES if c not in font.getBestCmap()]
    if missing:
        raise SystemExit(f"{source} lacks {', '.join(missing)}")
    out = io.BytesIO()
    font.flavor = "woff"
    font.save(out)
    return out.getvalue()


def font_face(woff: bytes) -> str:
    data = base64.b64encode(woff).decode("ascii")
    return "\n".join(
        [
            BEGIN,
            "/* Noto Sans Symbols 2, U+2400-U+2426 only: Copyright 2022 The Noto Project Authors",
            "   (https://github.com/notofonts/symbols), SIL Open Font License 1.1",
            "   (https://openfontlicense.org). */",
            "@font-face {",
            f'  font-family: "{FAMILY}";',
            f'  src: url("data:font/woff;base64,{data}")',  # as prettier lays it out
            '    format("woff");',
            "  unicode-range: U+2400-2426;",
            "  /* Noto draws them as small letters on a slant: larger, they read beside text,",
            "     and with a text font's ascent and descent they keep the line's height. */",
            "  size-adjust: 140%;",
            "  ascent-override: 70%;",
            "  descent-override: 15%;",
            "  line-gap-override: 0%;",
            "}",
            END,
        ]
    )


def main(source: str) -> None:
    css = CSS.read_text()
    block = font_face(subset_woff(Path(source)))
    if BEGIN in css:
        head, rest = css.split(BEGIN, 1)
        css = head + block + rest.split(END, 1)[1]
    else:
        raise SystemExit(f"{CSS} has no {BEGIN!r} line to replace")
    CSS.write_text(css)
    print(f"{CSS}: {len(block)} characters of @font-face for {FAMILY!r}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
