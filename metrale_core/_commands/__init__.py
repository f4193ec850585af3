"""The ``metrale`` command line and what it runs: on top, using the public API as a user does.

- `progress`: the progress line of long commands, on standard error;
- `bench`: ``metrale bench``, a package of its own (see its docstring);
- `conformance`, `selftest` and `runner`: the conformance verdict, the checked workload, and ``metrale run``
  (a script under metrale, its frameworks' tensors on the ledger);
- `commands`: each command's body, imported once a command is parsed;
- `cli`: the parser and the dispatch (``metrale --help`` loads neither settings nor a backend).

Each module imports only those listed before it; ``cli`` is on top.
"""
