"""Server-side syntax highlighting of config.pbtxt (protobuf text format): no JavaScript needed."""

import re

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

_TOKEN = re.compile(
    r'(?P<comment>#[^\n]*)|(?P<string>"(?:[^"\\]|\\.)*")|(?P<key>\b[a-z_][a-z0-9_]*\b(?=\s*[:{\[]))'
    r"|(?P<enum>\b[A-Z][A-Z0-9_]+\b)|(?P<number>-?\b\d+(?:\.\d+)?\b)|(?P<word>true|false)"
)


def highlight_pbtxt(text: str) -> SafeString:
    out: list[str] = []
    last = 0
    for match in _TOKEN.finditer(text):
        out.append(escape(text[last : match.start()]))
        out.append(f'<span class="tok-{match.lastgroup}">{escape(match.group())}</span>')
        last = match.end()
    out.append(escape(text[last:]))
    return mark_safe("".join(out))  # noqa: S308 - every piece above is escaped
