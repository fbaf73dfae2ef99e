"""Meshes, logical-axis rules and placement (issue 5)."""
