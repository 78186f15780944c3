"""activation layers."""
