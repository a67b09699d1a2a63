"""Build script: maps the design card's top-level folders onto the `moestream`
package and compiles the native read engine (`moestream._native`)."""

import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

SUBPACKAGES = ["shared", "client", "daemon"]


def _packages():
    from setuptools import find_packages

    found = ["moestream"]
    for top in SUBPACKAGES:
        found.append(f"moestream.{top}")
        found += [f"moestream.{top}.{p}" for p in find_packages(where=top)]
    return found


# The native sources compile side by side, one job per core (pybind11's helper; set
# NPY_NUM_BUILD_JOBS to change it): compiled one after another they are about a minute
# of a fresh install.
ParallelCompile(default=0).install()

extra_compile = ["-O3", "-Wall", "-Wextra"]
if sys.platform == "darwin":
    extra_compile.append("-mmacosx-version-min=11.0")

native = Pybind11Extension(
    "moestream._native",
    sources=sorted(str(p) for p in __import__("pathlib").Path("native").glob("*.cpp")),
    include_dirs=["native"],
    cxx_std=17,
    extra_compile_args=extra_compile,
    extra_link_args=["-pthread", "-ldl"] if sys.platform.startswith("linux") else [],
)

setup(
    packages=_packages(),
    package_dir={"moestream": "."} | {f"moestream.{t}": t for t in SUBPACKAGES},
    package_data={
        "moestream.daemon": ["demo/**/*"],
        "moestream.client": ["dashboard/static/*"],
        "moestream": ["launchd/*"],
    },
    ext_modules=[native],
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
