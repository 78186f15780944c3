"""container layers."""
