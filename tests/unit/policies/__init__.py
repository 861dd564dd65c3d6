"""The pure decision logic: budgets, caps, pricing, priority, rates, retries, routing."""
