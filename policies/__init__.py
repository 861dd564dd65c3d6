"""Pure admission decisions (no I/O): rate windows, budgets, reservations, priority and fairness, caps."""
