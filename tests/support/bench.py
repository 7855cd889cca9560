"""The one table `make bench` prints (tests/bench/conftest.py): every benchmark adds its rows."""

ROWS: list[tuple[str, str, str, str]] = []


class Report:
    def add(self, benchmark: str, measure: str, value: str, target: str = "") -> None:
        ROWS.append((benchmark, measure, value, target))
