"""`make bench` prints one table: every benchmark adds its rows to `report`."""

from collections.abc import Iterator

import pytest

from tests.support.bench import ROWS, Report
from tests.support.browser_fixtures import browser, page  # noqa: F401 (fixtures: a browser bench)


@pytest.fixture(scope="session")
def report() -> Iterator[Report]:
    yield Report()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not ROWS:
        return
    header = ("benchmark", "measure", "value", "target")
    widths = [max(len(row[i]) for row in [header, *ROWS]) for i in range(4)]
    terminalreporter.section("benchmarks")
    for row in [header, tuple("-" * w for w in widths), *ROWS]:
        terminalreporter.write_line("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
