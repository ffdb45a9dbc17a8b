"""vramplan's planner: pure data and arithmetic. It must never import torch."""
