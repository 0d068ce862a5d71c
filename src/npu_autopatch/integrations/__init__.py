"""Integrations with other libraries' own NPU patches: what makes them give way to ours.

Each module defines a ``Kernel`` that the model table (models.py) puts on that library's entry
point. Importable at interpreter start (the table imports them): stdlib and ``_types`` only.
"""
