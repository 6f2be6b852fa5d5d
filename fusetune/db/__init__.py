"""SQL state of the service: ORM models, sessions and the few query functions. The only place SQL lives."""
