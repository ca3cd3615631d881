"""setuptools' build of the scape package (pyproject.toml holds its metadata),
with one check: the package loads the libscape of an installed scaped, so
the build, and with it `pip install`, is refused when no libscape is where
`import scape` will look (scape/_find.py's places, the same code), naming
the places and the fix.  It runs at pip's metadata step, before any
dependency is fetched, and when the wheel is built; not for an sdist.  A
wheel, once built, installs without it (docs/python.md, "Installing")."""
import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.dist_info import dist_info


def _find():
    """scape/_find.py by its path: importing the package is not possible
    before it is installed."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scape", "_find.py")
    spec = importlib.util.spec_from_file_location("scape_find", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_libscape():
    find = _find()
    path, tried = find.first_present(beside=False)
    if path is not None:
        print("scape: libscape found: %s" % path)
        return
    raise SystemExit("scape: refusing to install: no libscape.so was found, and `import scape` "
                     "loads it from the installed scaped.\nLooked in:\n  %s\nFix: %s"
                     % ("\n  ".join(tried), find.FIX))


class CheckedDistInfo(dist_info):
    def run(self):
        check_libscape()
        super().run()


class CheckedBuildPy(build_py):
    def run(self):
        check_libscape()
        super().run()


setup(cmdclass={"dist_info": CheckedDistInfo, "build_py": CheckedBuildPy})
