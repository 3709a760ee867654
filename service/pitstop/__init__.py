"""pitstop: live migration of training workers between hosts."""
__version__ = "0.1.0"
