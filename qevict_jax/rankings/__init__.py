"""How important a window or a token is: attention mass, the rankings over it, the learned gates' network (docs/design.md §2)."""
