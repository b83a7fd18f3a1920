"""Tasks: what one training step computes and how a model is evaluated, per benchmark family."""
