"""Text "environments": prompt sets, reward functions and preference datasets ."""
