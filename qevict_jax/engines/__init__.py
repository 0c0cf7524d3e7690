"""The two engines: the window engine (routing plans and migrations, tiered attention) and the token-pool engine (docs/design.md §2)."""
