"""The KV methods, composed over the engines and the rankings, and their registry by name (docs/design.md §2)."""
