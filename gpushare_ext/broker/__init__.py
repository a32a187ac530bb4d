"""The per-host broker: scheduler core, policy, inventory, server, journal, actuators, metrics."""
