"""Training drafters on MLX: `distill` (the target answers prompts) and `train` (an EAGLE-3
drafter learns from the target's hidden states and distributions on those answers)."""
