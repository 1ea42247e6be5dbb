"""The command line's verbs, implemented: ``eagle-export validate``, ``bench``, ``tune``, ``gpu-check`` and ``demo``
each call into the module or package of that name here (``eagle_export/cli.py`` parses the options and calls them).

Research instruments whose questions are settled live in ``tools/lab/`` (outside the installed package); test
stand-ins in ``tools/testing/``; the fixture's recipe in ``tools/recipe/``.
"""
