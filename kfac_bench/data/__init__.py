"""Dataset builders that read each benchmark's real on-disk format."""
