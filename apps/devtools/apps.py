from django.apps import AppConfig


class DevtoolsConfig(AppConfig):
    """The local fleet launcher, the Triton simulator, the load generator and the seeding of a
    big fleet: tools for the demo, the tests and the benchmarks. No product app imports them."""

    name = "apps.devtools"
    label = "devtools"
