"""Text from people and from the fleet (titles, notes, reasons, model and node names) in the
Markdown reports, as text only: it adds no link, image, heading, list, emphasis, table cell or
raw HTML to the post-mortem it is pasted into (a bare address stays text that some renderers
show as a link, as they would anyway). The report templates turn autoescaping off (HTML entities
would show as written) and put every such value through one of these filters."""

import re

from django import template

register = template.Library()

# Characters that start Markdown (CommonMark, and GitHub's tables and strikethrough) or HTML
# anywhere in a line; a backslash makes any of them literal. Parentheses and "!" only matter
# after a "[", which is escaped; "_" inside a word emphasises nothing (rag_pipeline stays as
# written).
_INLINE = re.compile(r"([\\`*\[\]<>&|~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
# What starts a block only at the start of a line: a heading, a list item, a setext heading's
# underline, an ordered list item ("1." or "1)").
_LINE_START = re.compile(r"^([ \t]*)(?:([-+=#])|(\d+)([.)]))", re.M)


def _line_start(match: re.Match[str]) -> str:
    indent, mark, number, dot = match.groups()
    return f"{indent}\\{mark}" if mark else f"{indent}{number}\\{dot}"


@register.filter
def md(value: object) -> str:
    """One line of literal text: line breaks become spaces (a title cannot start a heading on a
    line of its own), every Markdown and HTML character is escaped."""
    return _INLINE.sub(r"\\\1", " ".join(str(value).split()))


@register.filter
def md_block(value: object) -> str:
    """Literal text keeping its lines (notes): escaped as `md`, and what would start a block
    at the start of a line escaped too."""
    lines = [_INLINE.sub(r"\\\1", line.rstrip()) for line in str(value).splitlines()]
    text = "\n".join(lines)
    return _LINE_START.sub(_line_start, text)


@register.filter
def md_code(value: object, table: str = "") -> str:
    """A code span holding the text literally (a name): fenced with more backticks than any run
    in it; in a table (`md_code:"table"`) its `|` escaped, which GitHub's tables read first."""
    text = " ".join(str(value).split())
    if table:
        text = text.replace("|", "\\|")
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"
