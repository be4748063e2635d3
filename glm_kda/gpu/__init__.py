"""The GPU side: its modules and their import order are listed in docs/design.md, "Python modules"."""
