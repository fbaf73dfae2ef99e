"""Meshes, logical-axis rules and placement, resharding, multi-process start-up and the memory planner."""
