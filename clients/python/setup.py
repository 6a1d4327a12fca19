"""Ships the contract with the package.

``provisioning_client`` generates its protobuf code from
``proto/provisioning/v1/provisioning.proto`` when imported. In the repository
it reads the file where it is; an installed package needs its own copy, which
the build step below puts into the package (``provisioning_client/proto/``)
from the repository, and a source distribution carries in the same place.
Everything else is in ``pyproject.toml``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PROTO = "provisioning/v1/provisioning.proto"
REPO_PROTO = HERE.parent.parent / "proto" / PROTO
# Where a source distribution keeps its copy (ignored by git in the repository).
PACKAGED_PROTO = HERE / "provisioning_client" / "proto" / PROTO


def _source() -> Path:
    for candidate in (REPO_PROTO, PACKAGED_PROTO):
        if candidate.is_file():
            return candidate
    raise SystemExit(f"cannot find {PROTO}: looked at {REPO_PROTO} and {PACKAGED_PROTO}")


class BuildPyWithProto(build_py):
    """``build_py`` that also copies the proto into the built package."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "provisioning_client" / "proto" / PROTO
        target.parent.mkdir(parents=True, exist_ok=True)
        self.copy_file(str(_source()), str(target))


class SdistWithProto(sdist):
    """``sdist`` that carries the proto inside the package directory."""

    def make_release_tree(self, base_dir, files) -> None:
        super().make_release_tree(base_dir, files)
        target = Path(base_dir) / "provisioning_client" / "proto" / PROTO
        target.parent.mkdir(parents=True, exist_ok=True)
        self.copy_file(str(_source()), str(target))


setup(cmdclass={"build_py": BuildPyWithProto, "sdist": SdistWithProto})
