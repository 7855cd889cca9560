from apps.quality.cases import Problem


class QualityError(Exception):
    """What was refused, and where: each problem names its line and field."""

    def __init__(self, problems: list[Problem] | str) -> None:
        self.problems = [Problem(0, "", problems)] if isinstance(problems, str) else problems
        super().__init__("; ".join(str(p) for p in self.problems))
