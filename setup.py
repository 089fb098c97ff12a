# The package list lives here because the repo-root kernels/ folder is installed as
# parashift.kernels, which pyproject's package discovery cannot express together with src/.
from setuptools import find_packages, setup

setup(packages=find_packages("src") + ["parashift.kernels", "parashift.kernels.cpu"],
      package_data={"parashift.kernels.cpu": ["*.cpp", "*.h"]})
