"""headwater: a real-time event and state platform for Python teams."""

__version__ = "0.1.0"
