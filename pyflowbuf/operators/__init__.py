"""Operators on batches of records: the operator contract (``Operator``,
``Output``), the basic operators and side outputs (see README.md)."""
