"""Packaging for gradaccum.

TensorFlow is deliberately not in ``install_requires``: a user on
``tensorflow-gpu==1.15`` must not get TensorFlow 2 pulled in. The ``[tf]``
extra installs the newest TensorFlow 2.x with ``tf-keras`` for those who
want it.
"""
import os

from setuptools import find_packages, setup

_HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
    path = os.path.join(_HERE, "gradaccum", "_version.py")
    scope = {}
    with open(path) as handle:
        exec(handle.read(), scope)
    return scope["__version__"]


_EXAMPLES = ["scikit-learn>=0.24", "matplotlib>=3.3", "progressbar2>=3.55"]
# Sphinx 9 needs Python 3.11; below that the docs test skips, with its reason.
_DOCS = [d + '; python_version >= "3.11"' for d in ["sphinx>=8", "myst-parser>=4", "furo>=2024.1"]]

setup(
    name="gradaccum",
    version=_version(),
    description="Exact gradient accumulation and synchronous multi-device "
    "training for TensorFlow 1.x graph mode.",
    long_description=open(os.path.join(_HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["gradaccum", "gradaccum.*"]),
    python_requires=">=3.7",
    entry_points={"console_scripts": ["gradaccum-launch = gradaccum.distributed.launch:main",
                                      "gradaccum-consolidate = gradaccum.distributed.consolidate:main"]},
    install_requires=["numpy"],
    extras_require={
        "tf": ["tensorflow>=2.15", "tf-keras>=2.15"],
        # tf-slim: tests/test_integrations.py (TF 2.x; TF 1.15 has tf.contrib.slim, and it installs there too).
        # pyyaml: tests/test_deploy.py checks its manifest reader against yaml.safe_load.
        # pytest-xdist: the README's test command runs on 2 workers (--dist loadgroup needs >= 2.5;
        # pip picks 3.5 on Python 3.7, the last release for it). pytest < 9.2: on 9.2 loadgroup silently
        # groups nothing (pytest-xdist issue 1386); tests/conftest.py refuses to run so.
        "test": ["pytest>=6,<9.2", "pytest-timeout>=1.4", "pytest-xdist>=2.5", "tf-slim>=1.1", "psutil>=5.6",
                 "pyyaml>=5.1"] + _EXAMPLES + _DOCS,
        "examples": _EXAMPLES,
        "docs": _DOCS,
        "bench": ["tensorpack>=0.11", "psutil>=5.6"],
    },
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
