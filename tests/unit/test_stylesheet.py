"""The stylesheet's colours resolve: a custom property defined through itself (`--ok-bg:
var(--ok-bg)`) is invalid in CSS, and every badge, breach row and pipeline box that uses it
loses its colour (an SVG box turns black)."""

import re

from tests.support import ROOT

STYLESHEET = ROOT / "static" / "app.css"


def test_no_colour_of_the_stylesheet_is_defined_through_itself() -> None:
    blocks = re.findall(r":root\s*\{([^}]*)\}", STYLESHEET.read_text())
    assert len(blocks) == 2  # the light theme and the dark one
    for block in blocks:
        defined = dict(re.findall(r"(--[\w-]+)\s*:\s*([^;]+);", block))
        for name in defined:
            seen, value = {name}, defined[name]
            while found := re.fullmatch(r"var\((--[\w-]+)\)", value.strip()):
                assert found[1] not in seen, f"{name} is defined through itself: {value}"
                seen.add(found[1])
                value = defined.get(found[1], "")
