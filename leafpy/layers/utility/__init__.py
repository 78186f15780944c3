"""utility layers."""
