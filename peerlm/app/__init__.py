"""The application layer: the ``peerlm`` CLI, the local federation, the compose generator and
the experiment runner. It composes the subsystems; nothing below it imports it."""
