"""What the fleet's services refuse, in words fit for the page."""


class FleetError(Exception):
    """A refused fleet change; the message says why and what to do instead."""
