"""mhagen's version (leaf module)."""
__version__ = "0.1.0"
