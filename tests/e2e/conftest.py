from tests.support.browser_fixtures import browser, page  # noqa: F401 (fixtures)
