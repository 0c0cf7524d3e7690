"""Training the learned gates (docs/design.md §2)."""
