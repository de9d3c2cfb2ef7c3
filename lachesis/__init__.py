"""The front door: the ``lachesis`` command (``cli``), the one-command supervisor
(``run``), and the tiny-model builder used by the demo and the tests.

It may import everything; nothing imports it (``environments`` and ``trainer`` never do,
a test keeps it so).
"""
