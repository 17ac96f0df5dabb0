"""Where role processes start: one small interface, one implementation per kind of host."""
