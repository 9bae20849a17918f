"""``clover-lab``, the command line: ``main.py`` parses and dispatches (``generate``, ``serve``,
``check``, ``routes``; ``adapt`` and ``train`` live in ``clover_lab.train``), ``options.py`` holds
what the subcommands share, ``view.py`` what ``generate`` prints, ``arguments.py`` the parser
whose usage errors are one line."""
