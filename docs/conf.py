"""Sphinx configuration: the API reference is built from the docstrings.

``tests/examples/test_docs.py`` builds it with warnings as errors, so a docstring that
does not render or a reference to a name that no longer exists fails the suite.
"""

project = "jaxfog"
author = "the jaxfog authors"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
# Every reference to a jaxfog name must resolve; names of other libraries
# (jax, optax, numpy, typing) are not checked.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!jaxfog\b).*"), (r"py:.*", r"jaxfog\.topology\.T\..*")]
exclude_patterns = ["_build"]
html_theme = "alabaster"
