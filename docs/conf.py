"""Sphinx configuration of gradaccum's documentation site (see docs/README.md).

The pages are MyST Markdown; the API reference is generated from the
Google-style docstrings (autodoc + napoleon), so autodoc imports gradaccum and
therefore TensorFlow. The build is nitpicky: a reference to one of our names
that does not resolve is an error; names of TensorFlow, NumPy and the
standard library, which this offline build cannot link (no intersphinx), are
listed in ``nitpick_ignore_regex`` below.
"""
import importlib.util
import inspect
import os
import sys

# As tests/conftest.py: tf.compat.v1.layers needs tf_keras on TF >= 2.16, and TensorFlow's
# start-up messages are not build output.
if importlib.util.find_spec("tf_keras") is not None:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gradaccum  # noqa: E402

project = "gradaccum"
author = "the gradaccum authors"
copyright = "the gradaccum authors"
release = version = gradaccum.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.autosummary", "sphinx.ext.napoleon"]
autosummary_generate = False  # The topic pages' tables link to the entries on the same page.
source_suffix = {".md": "markdown"}
root_doc = "index"
# compare_batches.md is a generated table that the Fashion-MNIST guide includes; README.md says how to build.
exclude_patterns = ["_build", "README.md", "compare_batches.md", "**/.ipynb_checkpoints", ".*"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links resolve, and are checked.

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # The library has no annotations; the docstrings' Args say the types.
autoclass_content = "class"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_preprocess_types = True
napoleon_attr_annotations = False

nitpicky = True
# Only names that are not ours: TensorFlow's, NumPy's, Python's, and the descriptions docstrings give in place
# of a type ("int64 scalar tensor": a target with a space is no Python name). A broken reference to a
# gradaccum name stays an error.
nitpick_ignore_regex = [
    (r"py:.*", r"(tf|np|numpy|tensorflow)\..*"),
    (r"py:.*", r".*\s.*"),
    # Internals that docstrings name but the API pages leave out on purpose.
    (r"py:.*", r"(gradaccum\.\w+\.)?(create|GROUP_KEY|skipped|CollectiveAllReduce\.apply_reduced)"),
]

# A fence without a language is program output: plain text, not Python.
highlight_language = "text"

html_theme = "furo"
html_title = "gradaccum %s" % release
html_show_sourcelink = False
html_theme_options = {"navigation_with_keys": True}


def _reexports():
    """(name where a user may find it, its home's name) for every re-exported class and function.

    ``gradaccum.Tower`` is ``gradaccum.tower.Tower``; ``gradaccum.cluster.CollectiveAllReduce`` is
    ``gradaccum.collective.CollectiveAllReduce``. The API page documents each object once, under
    one of its names; the others become aliases, so that both resolve.
    """
    pairs = []
    public = [("gradaccum", gradaccum)] + [("gradaccum." + n, getattr(gradaccum, n)) for n in gradaccum.__all__
                                           if inspect.ismodule(getattr(gradaccum, n))]
    for public_name, module in public:
        if module.__name__ != public_name:  # gradaccum.tower is gradaccum.devices.tower
            pairs.append((public_name, module.__name__))
        names = module.__all__ if module is gradaccum else [n for n in vars(module) if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__.startswith("gradaccum"):
                home = "%s.%s" % (obj.__module__, obj.__qualname__)
                for prefix in set([public_name, module.__name__]):
                    if home != "%s.%s" % (prefix, name):
                        pairs.append(("%s.%s" % (prefix, name), home))
    return pairs


def _add_aliases(app, env):
    """Makes every re-exported name resolve to the one place its object is documented.

    Aliases chain (``gradaccum.ClusterError`` -> ``gradaccum.cluster.ClusterError`` ->
    ``gradaccum.distributed.cluster.ClusterError``), so the pairs are resolved until none is left
    that can be. A name in ``gradaccum.__all__`` documented under none of its names is a warning
    (an error with -W).
    """
    from sphinx.util import logging

    domain = env.get_domain("py")
    pending = _reexports()
    while pending:
        left = [pair for pair in pending if not _alias(domain, *pair)]
        if len(left) == len(pending):
            break
        pending = left
    for alias, _ in pending:
        if alias.count(".") == 1:
            logging.getLogger(__name__).warning("%s (in gradaccum.__all__) is not in the API reference", alias)


def _alias(domain, alias, home):
    """Copies the entries of whichever of ``alias`` and ``home`` is known to the other; False if neither is."""
    source = next((name for name in (alias, home) if name in domain.objects), None)
    if source is None:
        return False
    target = home if source == alias else alias
    for name, entry in list(domain.objects.items()):
        if name == source or name.startswith(source + "."):
            new = target + name[len(source):]
            if new not in domain.objects:
                domain.objects[new] = entry._replace(aliased=True)
                if name in domain.modules:  # A module's reference resolves through its entry there.
                    domain.modules[new] = domain.modules[name]
    return True


def _skip_tuple_fields(app, what, name, obj, skip, options):
    """Leaves out a namedtuple's field accessors: its docstring's Attributes section describes them."""
    return True if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number") else None


def setup(app):
    app.connect("autodoc-skip-member", _skip_tuple_fields)
    app.connect("env-check-consistency", _add_aliases)
    return {"parallel_read_safe": True}
