"""The broker's settings: what it is told, read and checked before anything runs.

What it is for: every setting of the TOML file in one table (``schema.py``: what each
key accepts, its default, the words an admin reads when a value is wrong), the file's
text made into a document (``config_text.py``), the policy it yields (``policy.py``:
limits per user and group, priorities, which ladder level stops a lease) and the
broker's own configuration (``config.py``: socket, journal, inventory, limits, metrics).

What it must not import: any other wing of the broker.  The scheduler reads the policy,
the edges read the configuration; the settings know neither.  They import the ground
floor and the broker's error base (``broker/errors.py``) alone.
"""
