"""lockstep: deadlock-free upkeep of derived tables in PostgreSQL."""

__version__ = "0.1.0"
