"""A node's live web dashboard (`epibus up --ui-port N`): see docs/dashboard.md."""

from epibus.dashboard.server import Dashboard

__all__ = ["Dashboard"]
