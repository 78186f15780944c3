"""loss layers."""
