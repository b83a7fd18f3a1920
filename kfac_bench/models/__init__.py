"""Model builders for each benchmark family."""
