import pytest

# The shared helpers' asserts explain a failure as a test's own do: registered before they load.
pytest.register_assert_rewrite("tests.support")
